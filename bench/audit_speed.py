"""How fast `trex audit` scans a large tree: 10,000 synthetic files, one process, one core.

Writes the files to a temporary directory (100 packages x 100 files: portable modules, copies
of the CUDA-bound fixture modules, requirements files), scans them with the audit, and prints
files/s and the findings count; --write records them in docs/benchmarks.md between the
audit-bench markers (the rest of that file is left alone).

    .venv/bin/python bench/audit_speed.py --write    # 10,000 files, recorded in docs/benchmarks.md
    .venv/bin/python bench/audit_speed.py --files 2000   # printed only
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

from trex.audit import AuditConfig, run_audit

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- audit-bench -->", "<!-- /audit-bench -->"

HEADER = '''"""Module {i}: synthetic training code for the audit benchmark."""
import math

import torch
from torch import nn
'''

PORTABLE = '''

class Block{i}(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = torch.nn.functional.silu(h) * math.sqrt(2.0)
        return x + self.down(h)


def step_{i}(model, batch, device: torch.device):
    batch = batch.to(device, non_blocking=True)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = model(batch).float().pow(2).mean()
    loss.backward()
    torch.accelerator.synchronize()
    return {{"loss": loss.item(), "step": "{i}"}}
'''

# CUDA-bound code and requirements come from the audit's fixture repository, so that the
# vendor names stay in the audit's own data and the benchmark scans code with known findings.
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "audit" / "cuda_repo"
CUDA_BOUND = ("train_device.py", "train_dist.py", "kernels.py")
REQUIREMENTS = "requirements.txt"
BLOCKS_PER_FILE = 5  # about 120 lines per portable module


def module_source(template: str, i: int) -> str:
    return HEADER.format(i=i) + "".join(template.format(i=f"{i}_{j}") for j in range(BLOCKS_PER_FILE))


def generate(root: Path, n_files: int) -> int:
    """Write the tree; returns the total number of lines written."""
    cuda_sources = [(FIXTURE / name).read_text() for name in CUDA_BOUND]
    requirements = (FIXTURE / REQUIREMENTS).read_text()
    total = 0
    for i in range(n_files):
        package = root / f"pkg{i // 100:03d}"
        package.mkdir(exist_ok=True)
        kind = i % 10
        if kind == 9:
            path, text = package / f"requirements-{i}.txt", requirements
        elif kind >= 6:
            path, text = package / f"train_{i}.py", f"# synthetic module {i}\n" + cuda_sources[i % len(cuda_sources)]
        else:
            path, text = package / f"layer_{i}.py", module_source(PORTABLE, i)
        path.write_text(text)
        total += text.count("\n")
    return total


def update_docs(section: str) -> None:
    """Replace (or append) the text between the audit-bench markers, atomically."""
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    tmp = DOCS.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, DOCS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--write", action="store_true", help="record the figures in docs/benchmarks.md (default: print)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trex-audit-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        total_lines = generate(root, args.files)
        generated = time.perf_counter() - t0
        cpu0 = time.process_time()
        result = run_audit([str(root)], AuditConfig(root=str(root)))
        cpu = time.process_time() - cpu0
    rate = result.files_scanned / result.seconds
    lines = [
        "## trex audit scan speed",
        "",
        f"`bench/audit_speed.py`: {result.files_scanned} synthetic files, {total_lines} lines (60% portable "
        "modules, 30% CUDA-bound modules from the audit fixtures, 10% requirements files), one process.",
        "",
        "| files | wall s | CPU s | files/s | findings | skipped |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {result.files_scanned} | {result.seconds:.2f} | {cpu:.2f} | {rate:.0f} | {len(result.findings)} | "
        f"{len(result.skipped)} |",
        "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs shared; "
        f"generating the tree took {generated:.1f} s (not counted). Target: 10,000 files in under 60 s on one core.",
    ]
    print("\n".join(lines))
    if args.write:
        update_docs("\n".join(lines))
    return 0 if result.seconds < 60 or args.files != 10_000 else 1


if __name__ == "__main__":
    sys.exit(main())
