"""Measured training steps for the memory-model tests: one JSON line per case and rank.

    MALLOC_MMAP_THRESHOLD_=4096 python -m torch.distributed.run --nproc-per-node=2 \
        tests/plan_memory_worker.py '[{"overrides": {}, "seq": 512, "ep": 2, "recompute": "selective"}]' OUT_DIR

(or plain ``python tests/plan_memory_worker.py CASES OUT_DIR`` for one process). Each case builds the model
as ``trex train`` does (fp32, frozen indexer, activation checkpointing, expert parallelism and FSDP2
per block and root when distributed, MuonAdamW, ``grad_accum`` micro-batches of one sequence with
the reduce-scatter after the last), runs a warm-up step, resets the peak resident set
(clear_refs) and reports the VmHWM growth of the next step over the resident set before it.
MALLOC_MMAP_THRESHOLD_=4096 makes every tensor above 4 KiB its own mapping, so freed tensors leave the
resident set (``map_every_block`` sets the same in a process forked from a warm one, as the tests run it). The warm-up step also counts the bytes autograd saves for backward (storage-deduplicated,
parameters excluded), for the breakdown a failing test prints.
"""

import gc
import json
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule

from trex import device
from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.parallel.mesh import init_parallel, shutdown_distributed
from trex.parallel.plan import apply_parallelism
from trex.precision import PrecisionPolicy
from trex.train.moe_balance import freeze_indexer
from trex.train.optim import OptimSection, build_optimizer


def status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class SavedBytes:
    """saved_tensors_hooks that sum the distinct storages autograd keeps (parameters and their
    FSDP-unsharded copies excluded: those are counted by the weight terms)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            data = t.elem if isinstance(t, AsyncCollectiveTensor) else t  # expert parallelism's exchanged rows
            ptr = data.untyped_storage().data_ptr()
            if ptr not in self.seen:
                self.seen.add(ptr)
                self.total += data.untyped_storage().nbytes()
        return t


def run_case(case: dict, dev) -> dict:
    cfg, S = tiny(**case.get("overrides", {})), case["seq"]
    par = init_parallel(1, -1, case.get("ep", 1), 120, dev)
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0).train()
    freeze_indexer(model)
    # with oneDNN, a CPU bf16 run's resident set grows every step (flat without it): the CPU kernels'
    # memory, not the model's, so bf16 cases run ATen's own kernels
    torch.backends.mkldnn.enabled = case.get("dtype", "fp32") == "fp32"
    policy = PrecisionPolicy.resolve(case.get("dtype", "fp32"), dev)
    apply_parallelism(model, par, policy, case.get("recompute", "none"))
    opt = build_optimizer(model, OptimSection(name="muon"))
    grad_accum = case.get("grad_accum", 1)
    ids = torch.randint(0, cfg.vocab_size, (grad_accum, S), generator=torch.Generator().manual_seed(par.rank))

    def step(hooks=None) -> None:
        for i in range(grad_accum):  # as trex.posttrain.sft: reduce-scatter after the last micro-batch only
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == grad_accum - 1)
            counting = hooks is not None and i == 0  # saved bytes of one micro-batch
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t) if counting else nullcontext():
                out = model(ids[i:i + 1], labels=ids[i:i + 1], return_logits=False)  # as training: no logits
            (out.loss + 0.1 * out.mtp_loss).backward()
            del out
        opt.step()
        opt.zero_grad(set_to_none=True)

    saved = SavedBytes()
    step(saved)
    gc.collect()  # the previous case's FSDP modules are freed by the collector: not during the measured step
    if par.distributed:
        dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    step()
    result = {**case, "rank": par.rank, "step_peak": status("VmHWM") - base, "saved": saved.total}
    if par.distributed:
        dist.barrier()
    return result  # the model and optimizer go with this frame (FSDP's cycles: gc.collect above)


def map_every_block() -> None:
    """What MALLOC_MMAP_THRESHOLD_=4096 MALLOC_TRIM_THRESHOLD_=0 give a process at its start, set in this one
    (glibc's mallopt): every block above 4 KiB its own mapping, returned to the system when freed. A process
    forked from a warm one (tests/trex_run.py) read its environment before these were set."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not (libc.mallopt(m_mmap_threshold, 4096) and libc.mallopt(m_trim_threshold, 0)):
        raise RuntimeError("mallopt refused the thresholds")


# ---- used by the tests (tests/test_plan_memory_cpu.py, tests/test_plan_memory_distributed.py) ----------
SMALL = dict(hidden_size=256, num_attention_heads=8, head_dim=64, q_lora_rank=128, o_lora_rank=64, sliding_window=128,
             index_topk=64, index_head_dim=32, moe_intermediate_size=128, vocab_size=1024)
MiB = 2**20


def launch(cases: list[dict], nproc: int, timeout: int = 400) -> list[dict]:
    """Run ``cases`` in one process, or under torchrun on ``nproc`` gloo ranks; one result per case and rank.
    Each process is a child forked from a warm one (tests/trex_run.py: no ~4 CPU seconds of imports), which
    maps its blocks as MALLOC_MMAP_THRESHOLD_=4096 would (`map_every_block`: the warm process read its
    environment before)."""
    import os
    import tempfile

    from trex_run import python, torchrun

    env = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0", "TREX_DEVICE": "cpu"}
    here = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as out:
        args = [json.dumps(cases), out]
        if nproc == 1:
            code = f"import runpy, sys\nsys.argv = [{here!r}, *sys.argv[1:]]\nrunpy.run_path({here!r}, run_name='__main__')\n"
            proc = python(code, args, env=env, timeout=timeout)
        else:
            proc = torchrun(here, args, nproc=nproc, env=env, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [json.loads(line) for rank in range(nproc) for line in open(os.path.join(out, f"rank{rank}.jsonl"))]
    return sorted(results, key=lambda r: (r["case"], r["rank"]))


def predicted(case: dict, nproc: int):
    """The planner's memory breakdown for ``case`` at dp_shard = nproc, on a CPU profile."""
    from trex.hardware import HardwareProfile
    from trex.plan import Layout, TimeAssumptions, make_plan

    cpu = HardwareProfile(name="cpu", unit="card", peak_tflops={"fp32": 1.0, "bf16": 1.0}, memory_gib=64, intra_node_gbps=1,
                          inter_node_gbps=1, devices_per_node=1)
    layout = Layout(dp_shard=nproc, ep=case.get("ep", 1), grad_accum=case.get("grad_accum", 1),
                    recompute=case.get("recompute", "none"))
    assume = TimeAssumptions(dtype=case.get("dtype", "fp32"))
    return make_plan(tiny(**case.get("overrides", {})), layout, case["seq"], cpu, assume).memory


def explain(result: dict, memory) -> str:
    """Measured vs predicted step peak, with the predicted terms, for a failing assertion."""
    terms = ", ".join(f"{k} {v / MiB:.1f}" for k, v in memory.as_dict().items()
                      if k in ("activations", "gathered", "transient", "accumulated_gradients", "gradients",
                               "optimizer_workspace"))
    return (f"rank {result['rank']}: measured step peak {result['step_peak'] / MiB:.1f} MiB, predicted "
            f"{memory.step_peak / MiB:.1f} MiB (backward {memory.backward_peak / MiB:.1f}, optimizer "
            f"{memory.optimizer_peak / MiB:.1f}; {terms}); autograd saved {result['saved'] / MiB:.1f} MiB outside "
            f"checkpointed regions in one micro-batch")


def main(cases: str, out: str) -> None:
    """Each rank writes its results to ``out``/rank<R>.jsonl, a line per case (numbered ``case``)."""
    map_every_block()
    dev = device.detect("cpu")
    for i, case in enumerate(json.loads(cases)):
        result = {**run_case(case, dev), "case": i}
        with open(f"{out}/rank{result['rank']}.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
    shutdown_distributed()  # run_case's models are out of scope: every process group is freed here


if __name__ == "__main__":
    main(*sys.argv[1:])
