"""Compiled blocks: no graph break in any block kind, compiled training equals eager training (one
process under Inductor, and FSDP2 + expert parallelism on two under aot_eager), and a change of
packing does not recompile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from arithmetic_data import write_sft
from trex_run import trex
from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.models.deepseek_v4.context import SeqContext


# The compiled tests' models run 3 Sinkhorn iterations, not V4's 20: dynamo unrolls the loop, so each
# iteration is the same ops traced and lowered again (a fifth of a block's compile time at 20); 3 keep
# the loop, its first and later iterations, and its backward.
SINKHORN = 3


def test_every_block_kind_compiles_without_a_graph_break():
    """Sliding + hash MoE, CSA (indexer, top-k), HCA, an MTP block, the mHC head and the fused LM head
    + loss: one graph each under torch._dynamo.explain, the MoE dispatch included."""
    torch.manual_seed(0)
    cfg = tiny(sliding_window=16, hc_sinkhorn_iters=SINKHORN)
    model = build_model(cfg, seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    docs = torch.zeros_like(ids)
    docs[0, 23:] = 1
    ctx = SeqContext(cfg, ids, docs)
    X = model.embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    kinds = {}
    for block in model.layers:
        kinds.setdefault((block.layer_type, block.ffn.gate.hashed), block)
    assert len(kinds) == 3  # sliding/hash, CSA, HCA in the tiny preset
    cases = [(f"{kind} hashed={hashed}", block, (X, ctx)) for (kind, hashed), block in kinds.items()]
    cases.append(("mtp block", model.mtp[0], (X, model.embed(ids), ctx)))
    cases.append(("mHC head", model.hc_head, (X,)))
    h = torch.randn(2, 64, cfg.hidden_size)
    cases.append(("LM head + loss", model.head_nll, (h, ids)))
    for name, fn, args in cases:
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, f"{name}: {[b.reason for b in explained.break_reasons]}"
        assert explained.graph_count == 1, name


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return write_sft(d, n_train=400, n_eval=10)[0]


STEPS = 6  # the graphs are built in step 1; later steps check reuse and the curve
STEPS_SHARDED = 10  # FSDP + EP: the 10-step schedule whose curves agree within 1e-5 (a 6-step one: 4e-5)


# the sharded test's model: what FSDP2 + EP change in a compiled block is the MoE (hash- and score-routed);
# every attention kind, the MTP block and the heads are compiled and checked in one process
MOE_PAIR = (f'model.overrides={{sliding_window=16, hc_sinkhorn_iters={SINKHORN}, num_hidden_layers=2, layer_types=["sliding_attention", '
            '"sliding_attention"], mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=0}')


NO_MTP = f"model.overrides={{sliding_window=16, hc_sinkhorn_iters={SINKHORN}, num_nextn_predict_layers=0}}"


def _settings(sft_file, steps: int,
              model: str = f"model.overrides={{sliding_window=16, hc_sinkhorn_iters={SINKHORN}}}") -> list[str]:
    return [f'data.paths=["{sft_file}"]', 'data.tokenizer="compact"', "data.seq_len=64", "train.grad_accum=2",
            f"train.steps={steps}", "train.progress=false", "fidelity.every=0", "optim.lr=3e-3", model,
            "train.balance_alpha=0.01"]


def _curves(out) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def _assert_close(eager, compiled, steps, rel=1e-5):
    assert len(eager[0]) == len(compiled[0]) == steps
    for a, b in zip([*eager[0], *eager[1]], [*compiled[0], *compiled[1]]):
        assert abs(a - b) <= rel * abs(a), (eager, compiled)


@pytest.mark.slow
def test_compiled_training_equals_eager_and_never_recompiles(sft_file, tmp_path):
    """Inductor's lowering and fusion of every block kind, forward and backward, against eager. Its C++
    kernels are generated scalar (no SIMD), which skips the vectorised variants and takes 40% less
    compile time, and built at -O0 (``TORCHINDUCTOR_DEBUG_COMPILE``: what is tested is the generated code, not
    gcc's optimiser; 61 s against 80 s for this test with an empty Inductor cache); SIMD code generation is a CPU matter (accelerators generate Triton). The compiled run is
    a process of its own: Inductor caches the answer "no SIMD" for the life of a process, and a later
    compile in this one would then build a cached vectorised kernel without its ISA flags. The model has no
    MTP block: its graph is a sliding block's ops plus projections, norms and an mHC head that the other
    graphs lower too (its dynamo trace: test_every_block_kind_compiles_without_a_graph_break), and it
    cost a sixth of the compile time."""
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    curves, summaries = {}, {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        args = ["train", str(tmp_path / "recipe.toml"), "--out", str(out)]
        for setting in [*_settings(sft_file, STEPS, NO_MTP), "data.micro_batch_size=1",
                        f"train.compile={str(compiled).lower()}"]:
            args += ["--set", setting]
        if compiled:  # a separate process (see above), its kernels scalar and its wrapper C++
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0", "TORCHINDUCTOR_CPP_WRAPPER": "1",
                   "TORCHINDUCTOR_DEBUG_COMPILE": "1"}
            proc = subprocess.run([sys.executable, "-m", "trex", *args], capture_output=True, text=True, env=env,
                                  timeout=900)
        else:
            proc = trex(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves[compiled] = _curves(out)
        summaries[compiled] = json.loads((out / "summary.json").read_text())
    _assert_close(curves[False], curves[True], STEPS)
    assert summaries[False]["compile"] == {"enabled": False}
    graphs = summaries[True]["compile"]
    assert graphs["backend"] == "inductor"
    # every micro-batch packs its conversations differently (document boundaries move): no new graph after
    # step 1; the blocks of one kind share their graph (3 block kinds, mHC head, LM head + loss)
    assert graphs["graphs"] == graphs["graphs_after_first_step"] <= 5, graphs


@pytest.mark.slow
def test_compiled_fsdp_and_expert_parallel_equal_eager(sft_file, tmp_path):
    """What FSDP2 + EP change in a compiled block is tracing: the all-to-alls as functional collectives inside
    the graph and the partition of forward and backward around them. aot_eager builds exactly those graphs
    and runs them with eager kernels; Inductor's code generation for every block kind is the one-process
    test's (on an accelerator it generates Triton, which no CPU test reaches anyway)."""
    (tmp_path / "recipe.toml").write_text("# everything set on the command line\n")
    curves = {}
    for compiled in ("false", "true"):
        out = tmp_path / f"compile_{compiled}"
        args = ["train", str(tmp_path / "recipe.toml"), "--out", str(out)]
        for setting in [*_settings(sft_file, STEPS_SHARDED, MOE_PAIR), "data.micro_batch_size=1", "parallel.dp_shard=2",
                        "parallel.ep=2", 'train.compile_backend="aot_eager"',
                        f"train.compile={compiled}"]:
            args += ["--set", setting]
        proc = trex(args, procs=2, env={"TREX_DEVICE": "cpu"}, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves[compiled] = _curves(out)
    _assert_close(curves["false"], curves["true"], STEPS_SHARDED)
    compiled = json.loads((tmp_path / "compile_true" / "summary.json").read_text())["compile"]
    assert compiled["backend"] == "aot_eager" and compiled["graphs"] == compiled["graphs_after_first_step"], compiled
