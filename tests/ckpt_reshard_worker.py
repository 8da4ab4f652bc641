"""Run under torchrun: FSDP2-shard the tiny model over all ranks (gloo, CPU) and train it.

    save   DIR OUT: 3 steps, checkpoint at step 3 into DIR, 3 more steps; losses of steps 4-6 to OUT
    resume DIR OUT: load the step-3 checkpoint from DIR at this world size, 3 steps; losses to OUT

Each step's global batch is the same 4 sequences whatever the world size; rank r takes rows
r, r + W, ... and the loss is the global token mean, so every layout computes the same curve.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trex import device
from trex.models import build_model
from trex.models.config import tiny
from trex.models.deepseek_v4 import shift_labels
from trex.parallel.mesh import shutdown_distributed
from trex.checkpoint.training import RunState, load_checkpoint, save_checkpoint
from trex.train.optim import OptimSection, build_optimizer, clip_grad_norm
from trex.precision import StepGuard
from trex.train.schedule import ScheduleSection, build_scheduler

ROWS, SEQ = 4, 16


class StepCounter:
    """The data position: the next step's index (a stand-in for PackedLoader)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def step_loss(model, data: StepCounter, rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, 200, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 + data.step))
    data.step += 1
    targets = shift_labels(ids, 1, torch.zeros_like(ids))
    local_ids, local_targets = ids[rank::world], targets[rank::world]
    logits = model(local_ids).logits
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), ignore_index=-100,
                                              reduction="sum")
    count = (targets != -100).sum()
    (total / count * world).backward()  # FSDP averages gradients over ranks: the global mean's gradient
    loss = total.detach() / count
    dist.all_reduce(loss)
    return loss


def run(mode: str, directory: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(tiny(), seed=0)
    for layer in [*model.layers, *model.mtp]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, OptimSection(lr=3e-3))
    scheduler = build_scheduler(optimizer, ScheduleSection(warmup_steps=2), 6)
    data = StepCounter()
    state = RunState(model, optimizer, scheduler, StepGuard(3), data, device.detect("cpu"))

    def train_step() -> float:
        loss = step_loss(model, data, rank, world)
        clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        with torch.no_grad():  # the router bias buffers move every step, as in training
            for name, buf in model.named_buffers():
                if name.endswith("gate.bias"):
                    buf.add_(1e-3 * (torch.arange(buf.numel()) % 3 - 1))
        return loss.item()

    if mode == "save":
        for _ in range(3):
            train_step()
        save_checkpoint(directory, 3, state)
    else:
        assert load_checkpoint(os.path.join(directory, "step_3"), state).step == 3
    losses = [train_step() for _ in range(3)]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "world": world}, f)


def main() -> None:
    dist.init_process_group("gloo")
    run(*sys.argv[1:4])
    shutdown_distributed()  # the model and mesh are out of scope: every process group is freed here


if __name__ == "__main__":
    main()
