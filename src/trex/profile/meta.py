"""A training step's ops at any size, with no memory: the step run on the meta device under
``torch.profiler``, for trex.profile.estimate to price on a hardware profile.

Meta tensors carry shapes and dtypes but no data, so a 1.6 T checkpoint's step records the same op
list (GEMMs, attention kernels, elementwise ops, optimizer) that a device would run, in seconds and
with no memory. The step is the training loop's (trex.train.step.train_step: forward and backward of
``grad_accum`` micro-batches of ``rows`` x ``seq`` tokens, clipping, the guard, the optimizer) on one
fixed packed batch per micro-batch; one rank, no collectives (communication is not priced).
"""

from __future__ import annotations

import dataclasses

import torch

from trex import kernels
from trex.data import Batch
from trex.models import build_model
from trex.parallel.mesh import Parallel
from trex.parallel.plan import cast_for_compute
from trex.posttrain.objective import StepResult
from trex.posttrain.sft import accumulate_gradients
from trex.precision import StepGuard
from trex.profile.classes import StepProfile, classify
from trex.profile.scopes import label_model
from trex.train.config import TrainSection
from trex.train.optim import OptimSection, build_optimizer
from trex.train.step import train_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FixedBatches:
    """An SFT objective over fixed packed batches (one per micro-batch): the loop's step without a
    data pipeline."""

    def __init__(self, batches: list[Batch], cfg_train: TrainSection, par: Parallel):
        self.batches, self.cfg_train, self.par = batches, cfg_train, par

    def step(self, model, step, scaler):
        lm, mtp, aux = accumulate_gradients(model, self.batches, self.cfg_train, scaler, self.par)
        return StepResult(loss=lm, tokens=sum(b.n_tokens for b in self.batches), metrics={"mtp_loss": mtp},
                          moe_stats=aux.moe_stats)


def packed_batch(vocab: int, rows: int, seq: int, device: str | torch.device, seed: int = 0) -> Batch:
    """``rows`` rows of ``seq`` random tokens, two packed documents a row (the second from seq / 3)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    docs = torch.zeros_like(ids)
    docs[:, seq // 3:] = 1
    return Batch(ids, ids.clone(), docs, rows * (seq - 2), rows * seq,
                 torch.ones_like(ids, dtype=torch.bool)).to(device)


def trace_on_meta(cfg, seq: int, rows: int = 1, grad_accum: int = 1, dtype: str = "bf16",
                  optim: OptimSection | None = None) -> StepProfile:
    """The classed ops of one training step of the model ``cfg`` on the meta device (fp32 masters,
    compute in ``dtype``; Muon's iterations in bf16 when the compute is, as on an accelerator)."""
    kernels.prepare("meta")  # its probes stay out of the recorded step
    model = build_model(cfg, device="meta", dtype=torch.float32).train()
    cast_for_compute(model, DTYPES[dtype])
    optim = optim or OptimSection()
    if optim.ns_dtype == "auto":
        optim = dataclasses.replace(optim, ns_dtype="bf16" if dtype != "fp32" else "fp32")
    optimizer = build_optimizer(model, optim)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [packed_batch(cfg.vocab_size, rows, seq, "meta", seed=i) for i in range(grad_accum)]
    objective = FixedBatches(batches, dataclasses.replace(TrainSection(), grad_accum=grad_accum), Parallel())
    with label_model(model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    record_shapes=True) as prof:
        with torch.profiler.record_function("ProfilerStep#0"):
            train_step(model, objective, optimizer, params, StepGuard(3), 0, grad_clip=1.0, bias_gamma=1e-3,
                       par=Parallel())
    return classify(prof.events(), on_device=False)
