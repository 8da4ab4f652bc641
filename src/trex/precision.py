"""Precision policy, dynamic loss scaling and the non-finite step guard.

One `PrecisionPolicy` says which dtype every part of a run uses; the loop records
``policy.to_dict()`` with the run and in checkpoints. The three policies:

======  ===========  =============  ============  ============  ============
name    param dtype  compute dtype  master dtype  reduce dtype  loss scaling
======  ===========  =============  ============  ============  ============
fp32    fp32         fp32           fp32          fp32          no
bf16    fp32         bf16           fp32          fp32          no
fp16    fp32         fp16           fp32          fp32          dynamic
======  ===========  =============  ============  ============  ============

"param dtype" is what parameters are stored in: fp32 at every precision, so the stored parameters
are the master weights the optimizer updates (and its state is fp32). "compute dtype" is what the
forward and backward run in: each block sees its parameters cast to it (FSDP2's
``MixedPrecisionPolicy`` when sharded, `trex.parallel.plan.ComputeCast` in one process), and
gradients come back through the cast into fp32 ``.grad``, where micro-batches accumulate. "reduce
dtype" is the dtype of gradient reductions across ranks. This is mixed-precision training as
Micikevicius et al. (2018) define it; holding bf16 parameters and gradients instead rounds every
update into the weights and every micro-batch's gradient into the sum.

A step with a non-finite loss or gradient is skipped, never applied. `StepGuard` counts skips and
stops the run after ``max_consecutive_skips`` in a row; an fp16 overflow that the loss scaler can
still answer by backing off is counted but does not advance that limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import typing
from typing import Iterable, Literal

import torch

from trex import device as trex_device
from trex.models.common.linear import QuantSim
from trex.recipe import check_choices

log = logging.getLogger(__name__)

PrecisionName = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS = typing.get_args(PrecisionName)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrecisionSection:
    """The ``[precision]`` section of a recipe."""

    dtype: PrecisionName = "auto"
    """"auto" (bf16 on accelerators with fast bf16, else fp32), "fp32", "bf16" or "fp16"."""
    init_scale: float = 65536.0
    """fp16 only: the initial loss scale."""
    growth_factor: float = 2.0
    """fp16 only: the scale is multiplied by this after `growth_interval` overflow-free steps."""
    growth_interval: int = 1000
    """fp16 only: overflow-free steps between scale growths."""
    backoff_factor: float = 0.5
    """fp16 only: the scale is multiplied by this on every overflow."""
    min_scale: float = 1.0
    """fp16 only: the scale never drops below this."""
    max_consecutive_skips: int = 10
    """Stop the run after this many skipped steps in a row (non-finite loss or gradients)."""
    qat: str = "none"
    """Quantisation-aware training: simulate the served model's quantisation in the forward, with
    straight-through gradients into the master weights. "none"; "official" (everything the official
    inference code quantises); or parts joined by "+": experts (FP4 routed experts), linears (FP8
    weights), activations (FP8 GEMM inputs), kv (FP8 KV), indexer (Hadamard + FP4 indexer q/k)."""

    def __post_init__(self) -> None:
        check_choices(self, "precision")
        checks = {
            "init_scale": self.init_scale > 0, "growth_factor": self.growth_factor >= 1.0,
            "growth_interval": self.growth_interval >= 1, "backoff_factor": 0.0 < self.backoff_factor < 1.0,
            "min_scale": 0 < self.min_scale <= self.init_scale,
            "max_consecutive_skips": self.max_consecutive_skips >= 1,
        }
        self.quant_sim()  # a bad `qat` fails here, before step 1
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"precision.{bad[0]}: invalid value {getattr(self, bad[0])!r} (need init_scale > 0, "
                             "growth_factor >= 1, growth_interval >= 1, 0 < backoff_factor < 1, "
                             "0 < min_scale <= init_scale, max_consecutive_skips >= 1)")


    def quant_sim(self) -> QuantSim:
        """What ``qat`` asks the model to simulate (trex.models.common.linear.QuantSim)."""
        if self.qat == "none":
            return QuantSim()
        parts = QuantSim.PARTS if self.qat == "official" else tuple(self.qat.split("+"))
        unknown = [p for p in parts if p not in QuantSim.PARTS]
        if unknown or not parts:
            raise ValueError(f"precision.qat: {self.qat!r} is not a choice; use \"none\", \"official\" or parts "
                             f"joined by \"+\" from {list(QuantSim.PARTS)}")
        return QuantSim(**{p: True for p in parts})


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one run (see the module docstring for the table)."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype
    loss_scaling: bool

    @classmethod
    def resolve(cls, name: str, dev: trex_device.Device, warn_slow: bool = True) -> "PrecisionPolicy":
        """The policy for ``name`` ("auto", "fp32", "bf16", "fp16") on ``dev``.

        "auto" follows ``dev.default_dtype()``: bf16 on accelerators whose bf16 is fast, fp32
        otherwise (CPU runs are the correctness reference). Forcing bf16 where
        ``capabilities().bf16_fast`` is False works but warns (``warn_slow=False``: not, for what
        runs nothing, as ``--dry-run``); a dtype the device lacks is an error.
        """
        if name not in PRECISIONS:
            raise ValueError(f"precision.dtype: expected one of {list(PRECISIONS)}, got {name!r}")
        caps = dev.capabilities()
        if name == "auto":
            name = "bf16" if dev.default_dtype() == torch.bfloat16 else "fp32"
        elif name == "bf16" and not caps.bf16:
            raise ValueError(f"precision.dtype: bf16 was requested but device {dev.name} has no bf16 support")
        elif name == "fp16" and not caps.fp16:
            raise ValueError(f"precision.dtype: fp16 was requested but device {dev.name} has no fp16 support")
        if name == "bf16" and not caps.bf16_fast and warn_slow:
            log.warning("precision.dtype = bf16 on %s, where bf16 matmul measured slower than fp32; the run will be "
                        "slow (use dtype = \"auto\" or \"fp32\")", dev.name)
        return cls(name=name, param_dtype=torch.float32, compute_dtype=_DTYPES[name], master_dtype=torch.float32,
                   reduce_dtype=torch.float32, loss_scaling=name == "fp16")

    def to_dict(self) -> dict:
        """Plain strings for the run record and checkpoint metadata."""
        def short(dt: torch.dtype) -> str:
            return str(dt).replace("torch.", "")

        return {"name": self.name, "param_dtype": short(self.param_dtype), "compute_dtype": short(self.compute_dtype),
                "master_dtype": short(self.master_dtype), "reduce_dtype": short(self.reduce_dtype),
                "loss_scaling": self.loss_scaling}


class DynamicLossScaler:
    """fp16 dynamic loss scaling; with ``enabled=False`` every method is a no-op (scale 1).

    Per step: ``scale(loss).backward()``; ``unscale_(params)``; check the gradients (the global
    grad norm is non-finite exactly when some gradient overflowed); ``update(found_inf)``.
    On overflow the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) and the step
    must be skipped; after ``growth_interval`` clean steps in a row it grows by ``growth_factor``.
    """

    def __init__(self, enabled: bool = True, init_scale: float = 65536.0, growth_factor: float = 2.0,
                 growth_interval: int = 1000, backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.enabled = enabled
        self.growth_factor, self.growth_interval = growth_factor, growth_interval
        self.backoff_factor, self.min_scale = backoff_factor, min_scale
        self.scale_value = float(init_scale) if enabled else 1.0
        self.clean_steps = 0

    @classmethod
    def from_config(cls, cfg: PrecisionSection, policy: PrecisionPolicy) -> "DynamicLossScaler":
        return cls(enabled=policy.loss_scaling, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                   growth_interval=cfg.growth_interval, backoff_factor=cfg.backoff_factor, min_scale=cfg.min_scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> None:
        """Divide every gradient by the current scale, in place."""
        if not self.enabled:
            return
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def can_back_off(self) -> bool:
        """True while an overflow can still be answered by lowering the scale."""
        return self.enabled and self.scale_value > self.min_scale

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scale; a state saved without loss scaling (a run moving into fp16 from bf16 or
        fp32) leaves this scaler at its initial scale, and a disabled scaler ignores any state."""
        if self.enabled and state.get("enabled", True):
            self.scale_value = float(state["scale"])
            self.clean_steps = int(state["clean_steps"])


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradients."""


class StepGuard:
    """Decides each step whether the update counts, and counts skipped steps, in two halves so that
    the step itself never waits for the host:

    * ``finite(loss, grad_norm)`` (on the device, inside the step): [2] bool, whether the loss and
      the global grad norm (after unscaling) are finite; the optimizer and the router-bias update
      take ``.all()`` as their ``apply`` flag and leave every state unchanged where it is False.
    * ``record(loss_ok, norm_ok, step)`` (on the host, after the step's one read of its scalars):
      counts the skip, updates the loss scaler, and after ``max_consecutive`` skips in a row that the
      scaler cannot remedy raises `NonFiniteError`. Returns whether the step was applied.

    In distributed runs pass the all-reduced loss and the global norm, so every rank decides the same.
    """

    def __init__(self, max_consecutive: int, scaler: DynamicLossScaler | None = None):
        self.max_consecutive = max_consecutive
        self.scaler = scaler or DynamicLossScaler(enabled=False)
        self.skipped_total = 0
        self.consecutive = 0
        self.last_reason = ""
        # what the skips were (health()): a non-finite loss; finite loss, non-finite gradients; of
        # those, fp16 overflows the loss scaler answered by backing off
        self.nonfinite_loss = self.nonfinite_grad = self.overflows = 0

    @staticmethod
    def finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """[2] bool on the device: (loss finite, grad norm finite). No host read."""
        return torch.stack([loss.detach().float().isfinite().all(), grad_norm.detach().float().isfinite().all()])

    def record(self, loss_ok: bool, norm_ok: bool, step: int) -> bool:
        """The host half, with the flags ``finite`` computed for step ``step`` (1-based, as metrics
        number steps)."""
        remediable = loss_ok and not norm_ok and self.scaler.can_back_off()
        scale_before = self.scaler.scale_value
        self.scaler.update(found_inf=not norm_ok)
        if loss_ok and norm_ok:
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.nonfinite_loss += not loss_ok
        self.nonfinite_grad += loss_ok and not norm_ok
        self.overflows += remediable
        what = "loss" if not loss_ok else "gradients"
        self.last_reason = f"step {step}: non-finite {what}"
        if remediable:
            self.last_reason += f" (fp16 overflow; loss scale {scale_before:g} -> {self.scaler.scale_value:g})"
            return False
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.last_reason}: {self.consecutive} consecutive steps skipped (limit "
                f"precision.max_consecutive_skips = {self.max_consecutive}, {self.skipped_total} skipped in total). "
                "The run is diverging or the data has a bad batch: lower the lr, check the data around this step, "
                "or use fp32/bf16 if this is fp16 at its minimum loss scale.")
        return False

    def health(self, steps: int) -> dict:
        """What "no skipped step, no NaN" means for a run of ``steps`` optimizer steps, and its counts."""
        return {
            "definition": "a step is non-finite when its loss (summed over all ranks) or its global gradient "
                          "norm (after loss unscaling) is NaN or infinite; such a step is skipped: no optimizer "
                          "or router-bias update. Non-finite values inside a step that do not reach the loss or "
                          "the gradient norm are not seen",
            "steps": steps, "skipped_steps": self.skipped_total, "nonfinite_loss_steps": self.nonfinite_loss,
            "nonfinite_gradient_steps": self.nonfinite_grad, "fp16_overflow_steps": self.overflows,
            "clean": self.skipped_total == 0,
        }

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "consecutive": self.consecutive,
                "scaler": self.scaler.state_dict(),
                "counts": [self.nonfinite_loss, self.nonfinite_grad, self.overflows]}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = int(state["skipped_total"])
        self.consecutive = int(state["consecutive"])
        self.scaler.load_state_dict(state["scaler"])
        # checkpoints before the counts existed: every earlier skip counted as a gradient one
        self.nonfinite_loss, self.nonfinite_grad, self.overflows = state.get("counts", [0, self.skipped_total, 0])

