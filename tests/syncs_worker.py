"""Host syncs per training step under torchrun: runs ``trex.train.loop.train`` with a SyncCounter
around every step and writes one JSON line per rank (the events of each step).

    python -m torch.distributed.run --nproc-per-node=2 tests/syncs_worker.py OUT_DIR SFT_FILE [--set ...]
"""

import json
import os
import sys

from trex.parallel.mesh import shutdown_distributed
from trex.recipe import load
from trex.syncs import SyncCounter
from trex.train import loop
from trex.train.config import TrainRecipe


def main() -> None:
    out_dir, sft_file, *extra = sys.argv[1:]
    steps = []
    real = loop.train_step

    def counted(*args, **kwargs):
        with SyncCounter() as s:
            result = real(*args, **kwargs)
        steps.append(s.events)
        return result

    loop.train_step = counted
    recipe = load(TrainRecipe, overrides=[
        f'data.paths=["{sft_file}"]', 'data.tokenizer="compact"', "data.seq_len=64", "data.micro_batch_size=1",
        "train.steps=2", f'train.out="{out_dir}/run"', "train.progress=false", "fidelity.every=0",
        'model.overrides={sliding_window=16}', *extra])
    result = loop.train(recipe)
    layers = len(result.model.layers) + len(result.model.mtp)
    del result
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "moe_layers": layers, "steps": steps}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
