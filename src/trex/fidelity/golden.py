"""Golden references: a run stored as one JSON file (metrics, per-layer gradient norms, probe
fingerprints, the resolved recipe and the environment it ran in), loadable by `load_signals`."""

from __future__ import annotations

import os
import platform
import socket

import torch

from trex import atomic
import trex
from trex.fidelity.runs import GOLDEN_FORMAT, FidelityInputError, load_signals
from trex.posttrain.rollout_parity import PARITY_METRICS

# metrics.jsonl keys a reference keeps (timings, memory and MFU describe the machine, not convergence)
KEPT_METRICS = ("step", "loss", "mtp_loss", "grad_norm", "lr", "loss_scale", "skipped_steps", "tokens", "eval_loss",
                *PARITY_METRICS)


def export(run_path: str, out_path: str) -> dict:
    """Write the run at ``run_path`` (a run directory or a golden file) to ``out_path``; returns it."""
    signals = load_signals(run_path)
    if not signals.grad_norms or not signals.probe:
        raise FidelityInputError(f"{run_path}: no grad_norms.jsonl / probe.jsonl; train with [fidelity] every > 0 "
                                 "so the reference carries gradient and logit signals")
    golden = {
        "format": GOLDEN_FORMAT,
        "source": os.path.normpath(run_path),
        "metrics": [{k: r[k] for k in KEPT_METRICS if k in r} for _, r in sorted(signals.metrics.items())],
        "grad_norms": [{"step": s, "norms": n} for s, n in sorted(signals.grad_norms.items())],
        "probe": [r for _, r in sorted(signals.probe.items())],
        "config": signals.config,
        "environment": {**signals.environment, "trex": trex.__version__, "torch": torch.__version__,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "processor": platform.processor(), "host": socket.gethostname()},
        "summary": {k: signals.summary.get(k) for k in ("status", "steps_completed", "tokens", "skipped_steps",
                                                       "precision", "parallel") if k in signals.summary},
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    atomic.write_json(out_path, golden, indent=1)
    return golden


# The data of recipes/fidelity_default.toml: SFT conversations of two-digit sums and differences,
# generated here and committed under fidelity/data/ (a test regenerates and compares them).
DEFAULT_TASK = dict(digits=2, ops="+-", n_train=600, n_eval=40, problems_per_text=6, seed=0)
DEFAULT_DATA_FILES = ("arithmetic_sft.jsonl", "arithmetic_probe.jsonl")


def write_default_data(directory: str) -> list[str]:
    """Write the training and probe files of the default fidelity recipe; returns their paths."""
    from trex.data.arithmetic import ArithmeticTask, generate, sft_records
    from trex.data.records import write_jsonl

    os.makedirs(directory, exist_ok=True)
    train, held_out = generate(ArithmeticTask(**DEFAULT_TASK))
    paths = [os.path.join(directory, name) for name in DEFAULT_DATA_FILES]
    for path, problems in zip(paths, (train, held_out)):
        write_jsonl(path, sft_records(problems))
    return paths
