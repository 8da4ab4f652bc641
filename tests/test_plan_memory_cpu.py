"""The memory model against the measured peak of real single-process CPU training steps.

Each case runs in a fresh process (fp32, no recompute, the real MuonAdamW and a frozen indexer,
as trex train does). glibc keeps freed small blocks in its heap, which would hide a step's
growth, so the child sets MALLOC_MMAP_THRESHOLD_=4096: every tensor above 4 KiB is its own
mapping, returned to the system when freed. The baseline is the resident set after a warm-up
step (model and optimizer state exist, gradients freed); the measured peak is the VmHWM growth
during the next step. The planner's counterpart: activations + gradients + transient buffers +
optimizer workspace (weights and optimizer state are in the baseline).
Multi-process runs (FSDP/EP) are validated once trex's distributed training lands.
"""

import json
import os
import subprocess
import sys

import pytest

from trex.hardware import HardwareProfile
from trex.models.config import tiny
from trex.plan import Layout, TimeAssumptions, make_plan

CHILD = r"""
import json, sys, torch
from trex.models import build_model
from trex.models.config import tiny
from trex.train.moe_balance import freeze_indexer
from trex.train.optim import OptimConfig, build_optimizer

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

cfg, S = tiny(**json.loads(sys.argv[1])), int(sys.argv[2])
torch.manual_seed(0)
model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0).train()
freeze_indexer(model)
opt = build_optimizer(model, OptimConfig(name="muon"))
ids = torch.randint(0, cfg.vocab_size, (1, S))

def step():
    out = model(ids, labels=ids)
    (out.loss + 0.1 * out.mtp_loss).backward()
    del out
    opt.step()
    opt.zero_grad(set_to_none=True)

step()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
step()
print(json.dumps({"step_peak": status("VmHWM") - base}))
"""

SMALL = dict(hidden_size=256, num_attention_heads=8, head_dim=64, q_lora_rank=128, o_lora_rank=64, sliding_window=128,
             index_topk=64, index_head_dim=32, moe_intermediate_size=128, vocab_size=1024)
CPU = HardwareProfile(name="cpu", unit="card", peak_tflops={"fp32": 1.0}, memory_gib=64, intra_node_gbps=1,
                      inter_node_gbps=1, devices_per_node=1)


def _measured_step_peak(overrides: dict, S: int) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), str(S)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["step_peak"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
@pytest.mark.slow
@pytest.mark.parametrize("overrides,S", [({}, 512), (SMALL, 1024)], ids=["tiny-512", "small-1024"])
def test_predicted_step_memory_within_15_percent_of_measured(overrides, S):
    plan = make_plan(tiny(**overrides), Layout(dp_shard=1), S, CPU, TimeAssumptions(dtype="fp32"))
    m = plan.memory
    predicted = m.activations + m.gradients + m.transient + m.optimizer_workspace
    measured = _measured_step_peak(overrides, S)
    assert predicted == pytest.approx(measured, rel=0.15), f"predicted {predicted / 2**20:.1f} MiB, " \
                                                            f"measured {measured / 2**20:.1f} MiB"
