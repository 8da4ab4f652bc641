"""Host syncs per training step under torchrun: runs ``trex.train.loop.train`` with a SyncCounter
around every step, once per case (a JSON list of override lists, one launch for every layout), and
writes one JSON file per case and rank (the events of each step).

    python -m torch.distributed.run --nproc-per-node=2 tests/syncs_worker.py OUT_DIR SFT_FILE CASES_JSON
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
    out_dir, sft_file, cases = sys.argv[1:]
    real = loop.train_step
    rank = int(os.environ.get("RANK", "0"))
    for i, extra in enumerate(json.loads(cases)):
        steps = []

        def counted(*args, **kwargs):
            with SyncCounter() as s:
                result = real(*args, **kwargs)
            steps.append(s.events)
            return result

        loop.train_step = counted
        recipe = load(TrainRecipe, overrides=[
            f'data.paths=["{sft_file}"]', 'data.tokenizer="compact"', "data.seq_len=64", "data.micro_batch_size=1",
            "train.steps=2", f'train.out="{out_dir}/run{i}"', "train.progress=false", "fidelity.every=0",
            'model.overrides={sliding_window=16}', *extra])
        result = loop.train(recipe)
        layers = sum(hasattr(block.ffn, "experts") for block in (*result.model.layers, *result.model.mtp))  # MoE
        del result
        with open(os.path.join(out_dir, f"case{i}_rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "moe_layers": layers, "steps": steps}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
