"""Sampling from the FSDP2-sharded model (and FSDP + EP=2) on 2 gloo processes gives the tokens of
the plain model with the same weights. Rank 0 has two batches, rank 1 one (it runs a dummy batch
while rank 0 decodes its second), and one row stops early: no rank may hang.

This file is also the worker: ``torchrun ... tests/test_rollout_distributed.py OUT EP``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

PROMPTS = [[5, 6, 7], list(range(9, 20)), [3, 4], list(range(40, 46))]
RANK_PROMPTS = {0: [0, 1, 2], 1: [3]}


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_sharded_sampling_matches_one_process(tmp_path, ep):
    from trex_run import torchrun  # each rank forked from a warm process

    out = tmp_path / "result.json"
    proc = torchrun(os.path.abspath(__file__), [str(out), str(ep)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result.json.{r}").read_text()) for r in range(2)]
    stopped = 0
    for rank, res in enumerate(results):
        expected = [res["reference"][i] for i in RANK_PROMPTS[rank]]
        assert [r["completion"] for r in res["sharded"]] == [e["completion"] for e in expected], f"rank {rank}"
        for got, want in zip(res["sharded"], expected):
            assert got["finished"] == want["finished"]
            assert all(abs(a - b) <= 1e-5 for a, b in zip(got["logprobs"], want["logprobs"]))
            stopped += got["finished"]
    assert stopped >= 1  # a row ended early while the others went on


def _worker(out: str, ep: int) -> None:

    from trex import device
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.parallel.mesh import init_parallel
    from trex.parallel.plan import apply_parallelism
    from trex.precision import PrecisionPolicy
    from trex.rollout import SamplingParams, sample

    dev = device.detect()
    par = init_parallel(1, 2, ep, 600, dev)  # generous: CI machines may be busy
    model = build_model(tiny(index_n_heads=16), seed=0).eval()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    stop = sample(model, PROMPTS[:1], greedy, pad_id=0).completion_ids[0][2]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_ids=(stop,))
    reference = sample(model, PROMPTS, params, pad_id=0)
    apply_parallelism(model, par, PrecisionPolicy.resolve("fp32", dev))
    mine = [PROMPTS[i] for i in RANK_PROMPTS[par.rank]]
    sharded = sample(model, mine, params, pad_id=0, batch_size=2)

    def rows(s):
        return [{"completion": c, "logprobs": lp, "finished": f}
                for c, lp, f in zip(s.completion_ids, s.logprobs, s.finished)]

    with open(f"{out}.{par.rank}", "w") as f:
        json.dump({"reference": rows(reference), "sharded": rows(sharded)}, f)


if __name__ == "__main__":
    from trex.parallel.mesh import shutdown_distributed

    _worker(sys.argv[1], int(sys.argv[2]))
    shutdown_distributed()  # the sharded model is out of scope: every process group is freed here
