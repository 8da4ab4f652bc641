"""trex plan with tensor parallelism (Layout.tp; the V3 family, V4 and V4.1): what TP splits and what it leaves whole,
its per-layer collectives, the layout checks, the search, the default and nearest fitting layouts, and the
published torchtitan-npu runs (docs/planning.md#tensor-parallelism-and-the-published-runs)."""

import dataclasses
import json

import pytest

from trex.cli import main
from trex.hardware import load_profiles
from trex.models import get_preset
from trex.plan import Layout, make_plan, search
from trex.plan.model_facts import model_facts
from trex.plan.timing import tp_traffic

TINY_V3 = get_preset("tiny-v3")
H100 = load_profiles()["h100-sxm"]
DIE = load_profiles()["ascend-910c-die"]


def _tiny_v3_whole_by_hand(cfg) -> int:
    """Parameters TP leaves whole in tiny-v3, from its shapes: per block MLA's wq_a, wkv_a and their norms and the
    two block norms; the router in MoE blocks; an MTP block's enorm, hnorm, final norm and eh_proj [d, 2d] (whole on
    every TP rank, trex.models.deepseek_v3.tp_plan); the model's final norm."""
    d = cfg.hidden_size
    attention = d * cfg.q_lora_rank + cfg.q_lora_rank + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) \
        + cfg.kv_lora_rank + 2 * d
    router = cfg.n_routed_experts * d
    dense, moe = cfg.first_k_dense_replace, cfg.num_hidden_layers - cfg.first_k_dense_replace
    mtp = cfg.num_nextn_predict_layers
    return dense * attention + moe * (attention + router) + mtp * (attention + router + 3 * d + 2 * d * d) + d


def test_tp_memory_per_rank_by_hand():
    facts = model_facts(TINY_V3)
    whole = _tiny_v3_whole_by_hand(TINY_V3)
    assert facts.tp_whole_stored == facts.tp_whole_trainable == whole == 29184
    plain = make_plan(TINY_V3, Layout(dp_shard=2, ep=2, recompute="full"), 64, H100)
    tp2 = make_plan(TINY_V3, Layout(dp_shard=2, ep=2, tp=2, recompute="full"), 64, H100)
    # fp32 weights: TP's split parts halve on each TP rank, then FSDP over dp_shard = 2
    assert tp2.memory.weights == 4 * (whole + (facts.stored - whole) / 2) / 2
    assert plain.memory.weights == 4 * facts.stored / 2
    assert tp2.memory.optimizer == 4 * (facts.tp_whole_muon + (facts.muon - facts.tp_whole_muon) / 2) / 2 \
        + 8 * ((whole - facts.tp_whole_muon) + (facts.adamw - (whole - facts.tp_whole_muon)) / 2) / 2
    # sequence parallelism: a checkpointed block keeps 1 / tp of its input rows; the heads' terms shrink too
    assert tp2.memory.activations < plain.memory.activations


def test_tp_collective_volume_and_time_by_hand():
    layout = Layout(dp_shard=2, tp=2, grad_accum=3, sequence_parallel=False)
    cfg, S, b = TINY_V3, 64, 2
    d, q, kv, rd = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers  # each with a dense FFN or shared experts
    heads = 1 + cfg.num_nextn_predict_layers
    # without sequence parallelism, all-reduces (2 buffers each): per block forward the attention's and the FFN's
    # outputs [S, d], backward the gradients of what enters the heads (wq_b's input, the KV latent, k_pe) and the
    # FFN's input; per head the embedding's sum, the loss's 3 statistics and its fp32 hidden-state gradient
    forward, backward = blocks * 2 * d * S, blocks * (q + kv + rd + d) * S
    losses = heads * (d * S + 2 * (3 + d) * S)
    assert tp_traffic(cfg, layout, S, b) == 2 * b * (forward + backward + losses)
    full = dataclasses.replace(layout, recompute="full")
    assert tp_traffic(cfg, full, S, b) == 2 * b * (2 * forward + backward + losses)  # the forward's again
    # with it, the norms' outputs all-gathered into each region and its output reduce-scattered (the forward's
    # bytes), the outputs' gradients all-gathered [S, d] per region, each head's input rows all-gathered, and the
    # gradients of what computes on a rank's rows summed: per block two norms, the final norm, per MTP module
    # enorm, hnorm, norm and eh_proj [d, 2d]
    params = blocks * 2 * d + d + cfg.num_nextn_predict_layers * (3 * d + 2 * d * d)
    sp = dataclasses.replace(layout, sequence_parallel=True)
    assert tp_traffic(cfg, sp, S, b) == b * (2 * (forward + backward + losses) + blocks * 2 * d * S + heads * d * S
                                             + 2 * params)
    plan = make_plan(cfg, layout, S, H100)  # 4 devices, one node: the intra-node link, a ring of 2
    assert plan.time.tp_comm == pytest.approx(3 * 2 * b * (forward + backward + losses) * (1 / 2)
                                              / (H100.intra_node_gbps * 1e9))
    assert make_plan(cfg, Layout(dp_shard=4, ep=2), S, H100).time.tp_comm == 0


@pytest.mark.parametrize("model, layout, message", [
    ("tiny-v3", "dp_shard=2,tp=8", "layout: tp=8 does not divide the model's attention heads 4"),
    ("deepseek-v3", "dp_shard=32,tp=3,ep=32",
     "layout: tp=3 does not divide the model's attention heads 128, vocabulary 129280, shared-expert width 2048"),
    ("deepseek-v3", "dp_shard=4,tp=4,ep=32", "layout: ep=32 must divide dp_shard x cp x tp = 4 x 1 x 4"),
    ("tiny-v4.1", "dp_shard=2,tp=4,ep=2", "layout: tp=4 does not divide the model's output groups 2"),
    ("deepseek-v4-flash", "dp_shard=8,tp=16,ep=8", "layout: tp=16 does not divide the model's output groups 8"),
    ("deepseek-v4-flash", "dp_shard=32,tp=3,ep=32", "layout: tp=3 does not divide the model's attention heads 64, "
                                                    "output groups 8, vocabulary 129280, shared-expert width 2048"),
])
def test_a_layout_tp_cannot_split_is_one_line_naming_the_numbers(model, layout, message, capsys):
    assert main(["plan", "--model", model, "--hardware", "h100-sxm", "--seq", "64" if model.startswith("tiny") else
                 "4096", "--layout", layout]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_search_finds_tp_layouts_for_v3():
    args = (get_preset("deepseek-v3"), 128, 4096, 4194304, DIE)
    narrow = dict(optimizer="adamw", micro_batches=(1,), recompute=("full",), offload=(True,))
    plans = search(*args, **narrow)
    assert {p.layout.tp for p in plans} >= {1, 2, 4, 8}
    assert all(p.layout.tp <= DIE.devices_per_node and p.layout.train_refusal() is None for p in plans)
    # with the experts over ep / tp ranks of dp_shard x the tp ranks (torchtitan's placement, which trex train
    # runs) TP beats every tp = 1 layout that fits here
    assert plans[0].layout.tp > 1 and plans[0].layout.ep > plans[0].layout.dp_shard, plans[:1]


TINY_V4 = get_preset("tiny")


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4.1"])
def test_v4_tp_split_is_what_the_trainers_plan_splits(preset):
    """model_facts.TP_SPLIT names exactly the parameters trex.models.deepseek_v4.tp_plan (tp_plan_v41) splits."""
    import re

    from trex.models import build_model
    from trex.parallel.tensor_parallel import planned_modules, tp_plan
    from trex.plan.model_facts import TP_SPLIT

    model = build_model(get_preset(preset), device="meta")
    split = set()
    for path, (_, styles) in planned_modules(model, tp_plan(model)).items():
        for style in styles:
            kind, _, arg = style.partition(":")
            if kind in ("colwise", "colwise_within", "rowwise", "vocab"):
                split.add(f"{path}.weight")
            elif kind == "heads_param":
                split.add(f"{path}.{arg}")
    assert {n for n, _ in model.named_parameters() if re.search(TP_SPLIT, n)} == split


def test_v4_weights_per_rank_fall_as_the_split_predicts():
    cfg, facts = TINY_V4, model_facts(TINY_V4)
    d, H, c, q, g, r = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                        cfg.o_lora_rank)
    # per block (4 main + 1 MTP): attn_sink, wq_b, wo_a, wo_b, the shared expert's w1, w3, w2; embedding and head
    per_block = H + q * H * c + H * c // g * g * r + g * r * d + 3 * d * cfg.moe_intermediate_size
    split = 5 * per_block + 2 * cfg.vocab_size * d
    assert facts.tp_whole_stored == facts.stored - facts.experts - split
    plain = make_plan(cfg, Layout(dp_shard=2, ep=2, recompute="full"), 64, H100)
    tp2 = make_plan(cfg, Layout(dp_shard=2, ep=2, tp=2, recompute="full"), 64, H100)
    # fp32: the split parts and the routed experts (ep over dp_shard x tp) halve on each TP rank, then FSDP over 2
    assert tp2.memory.weights == 4 * (facts.tp_whole_stored + (facts.stored - facts.tp_whole_stored) / 2) / 2
    assert plain.memory.weights == 4 * facts.stored / 2
    assert tp2.memory.activations < plain.memory.activations  # the heads' terms, the shared expert's width


def test_v4_attention_activations_split_by_heads_and_groups():
    from trex.models.deepseek_v4 import plan_terms as v4

    cfg, S, b = TINY_V4, 64, 2
    for kind in dict.fromkeys(cfg.layer_types):
        whole, half = v4.attention(cfg, kind, S, b), v4.attention(cfg, kind, S, b, tp=2)
        H, c, g, r = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        _, kc, _ = v4.compressed_seen(cfg, kind, S)
        K = cfg.sliding_window // 4 + cfg.sliding_window
        # per token, per head: the heads' norm (fp32 input, rstd), wo_a's input, q, the probabilities; wo_b's input
        per_head = 4 * (c + 1) + b * c + b * c + 4 * (K + kc + 1)
        assert whole - half == S * (H // 2 * per_head + b * g // 2 * r), kind
    assert v4.stream_bytes(cfg, b, rows=2) == v4.stream_bytes(cfg, b) / 2  # sequence parallelism: half the rows


def test_v4_tp_collective_volume_by_hand():
    cfg, S, b = TINY_V4, 64, 2
    d, c, q = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    # per block, all-reduces (2 buffers each): forward wo_b's and the shared w2's outputs [S, d]; backward the
    # gradients of wq_b's input [S, q], the K = V head [S, c], the compressed entries [S / m, c] and the shared
    # expert's input [S, d] (once for w1 and w3)
    entries = sum(S // cfg.compress_rate(t) for t in cfg.layer_types if t != "sliding_attention")
    entries += S // cfg.compress_rate(cfg.mtp_layer_type) if cfg.mtp_layer_type != "sliding_attention" else 0
    blocks = cfg.num_hidden_layers + 1
    forward = blocks * 2 * d * S
    backward = blocks * (q + c + d) * S + entries * c
    heads = 2 * d * S + 2 * 2 * (3 + d) * S  # two embedding lookups [S, d]; two losses' 3 stats and dh, fp32
    layout = Layout(dp_shard=2, tp=2, sequence_parallel=False)
    assert tp_traffic(cfg, layout, S, b) == 2 * b * (forward + backward + heads)
    full = dataclasses.replace(layout, recompute="full")
    assert tp_traffic(cfg, full, S, b) == 2 * b * (2 * forward + backward + heads)  # the forward's again
    plan = make_plan(cfg, layout, S, H100)
    assert plan.time.tp_comm == pytest.approx(2 * b * (forward + backward + heads) / 2 / (H100.intra_node_gbps * 1e9))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("preset,ep", [("tiny", 1), ("tiny-v4.1", 1), ("tiny-v3", 1), ("tiny-moonlight", 1),
                                       ("tiny", 2), ("tiny-v3", 2)])
def test_tp_traffic_is_what_a_tp2_step_moves(preset, ep, sequence_parallel, monkeypatch):
    """Each family's tp_traffic is the ring bytes of the collectives trex.parallel.tensor_parallel (and, with
    ep = 2, the expert-parallel group that is the tp group: trex.parallel.expert_parallel) issues in one forward +
    backward of the model split at tp = 2 (every head's loss; fp32: 4 bytes), with sequence parallelism and
    without, counted in one process over a fake process group (tests/tp_counting.py): the all-reduces, all-gathers
    and reduce-scatters."""
    from tp_counting import Collectives, fake_tp, split_model, training_step

    cfg, S = get_preset(preset), 64
    with fake_tp(2) as mesh:
        model = split_model(cfg, mesh, sequence_parallel, experts=ep > 1)
        counted = Collectives(monkeypatch)
        training_step(model, S, counted)
    layout = Layout(dp_shard=1, tp=2, ep=ep, sequence_parallel=sequence_parallel)
    assert counted.bytes == tp_traffic(cfg, layout, S, 4)


TINY_V41 = get_preset("tiny-v4.1")


def test_v41_weights_per_rank_fall_as_the_split_predicts():
    """V4.1 as tp_plan_v41 splits it: CSA2's wq_b, sinks, wo_a and wo_b and the shared expert split, Engram whole
    (its wkv and gains on every rank; its tables row-split over every rank, apart), as is V4's K = V head."""
    cfg, facts = TINY_V41, model_facts(TINY_V41)
    d, H, c, q, g, r = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                        cfg.o_lora_rank)
    assert cfg.num_nextn_predict_layers == 0 or facts.mtp == 0  # DSpark stages are not built into the model
    per_block = H + q * H * c + H * c // g * g * r + g * r * d + 3 * d * cfg.moe_intermediate_size
    split = cfg.num_hidden_layers * per_block + 2 * cfg.vocab_size * d
    assert facts.tp_whole_stored == facts.stored - facts.experts - split
    plain = make_plan(cfg, Layout(dp_shard=2, ep=2, recompute="full"), 64, H100)
    tp2 = make_plan(cfg, Layout(dp_shard=2, ep=2, tp=2, recompute="full"), 64, H100)
    # fp32: as V4's, and the Engram tables split by rows over every rank (4 with tp=2, 2 without)
    tables = facts.engram_tables
    assert tables and tp2.memory.weights == 4 * (facts.tp_whole_stored + (facts.stored - facts.tp_whole_stored) / 2) \
        / 2 + 4 * tables / 4
    assert plain.memory.weights == 4 * facts.stored / 2 + 4 * tables / 2
    assert tp2.memory.activations < plain.memory.activations
    # the whole trained matmuls every TP rank runs on the group's rows: wq_a, the K = V head, the router, a KV
    # source's compressor (wkv, and wgate where it pools: ratio > 1) and Engram's wkv (its looked-up rows to the
    # value and the hc keys); not the indexer
    engram_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    matmul = cfg.num_hidden_layers * (d * q + d * c + cfg.n_routed_experts * d)
    matmul += sum((2 if cfg.layer_ratios[i] > 1 else 1) * d * c for i in cfg.kv_source_layer_ids)
    matmul += len(cfg.engram_layer_ids) * engram_in * d * (cfg.hc_mult + 1)
    assert facts.tp_whole_matmul == matmul


def test_v41_tp_collective_volume_by_hand():
    """As V4's, with only the KV sources' compressed entries entering the heads (the layers after a source reuse
    them) and no MTP block: one embedding and one loss."""
    cfg, S, b = TINY_V41, 64, 2
    d, c, q = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    entries = sum(S // cfg.layer_ratios[i] for i in cfg.kv_source_layer_ids if cfg.layer_ratios[i])
    blocks = cfg.num_hidden_layers
    forward = blocks * 2 * d * S
    backward = blocks * (q + c + d) * S + entries * c
    heads = d * S + 2 * (3 + d) * S
    layout = Layout(dp_shard=2, tp=2, sequence_parallel=False)
    assert tp_traffic(cfg, layout, S, b) == 2 * b * (forward + backward + heads)
    selective = dataclasses.replace(layout, recompute="selective")  # wo_b's all-reduce again
    assert tp_traffic(cfg, selective, S, b) == 2 * b * (forward + blocks * d * S + backward + heads)
    plan = make_plan(cfg, layout, S, H100)
    assert plan.time.tp_comm == pytest.approx(2 * b * (forward + backward + heads) / 2 / (H100.intra_node_gbps * 1e9))


def test_the_search_considers_tp_for_v4(capsys):
    plans = search(get_preset("deepseek-v4-flash"), 128, 4096, 4194304, DIE, optimizer="adamw", micro_batches=(1,),
                   recompute=("full",), offload=(True,), largest_ep_only=True)
    assert {p.layout.tp for p in plans} == {1, 2, 4, 8}  # o_groups = 8 bounds it
    assert main(["plan", "--model", "deepseek-v4-flash", "--hardware", "ascend-910c-die", "--seq", "4096",
                 "--optimizer", "adamw", "--layout", "dp_shard=64,tp=2,ep=64"]) in (0, 1)
    assert "tp=2" in capsys.readouterr().out


def test_v32_indexer_is_whole_on_every_tp_rank():
    """trex's V3.2 plan (and torchtitan-npu's: NoParallel) replicates the lightning indexer: its weights are whole on
    every TP rank, which runs all of it on the group's rows."""
    from trex.models.deepseek_v3.plan_terms import counted_model, indexer_per_layer
    from trex.plan.timing import tp_whole_flops, training_flops

    cfg = get_preset("tiny-v3.2")
    v3, v32 = model_facts(counted_model(cfg)[0]), model_facts(cfg)  # the dense V3 model, and with the indexers
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert v32.tp_whole_stored - v3.tp_whole_stored == blocks * indexer_per_layer(cfg)
    extra, again = tp_whole_flops(cfg, v32, 64, 2, "full")
    assert extra == 6 * v32.tp_whole_matmul + training_flops(cfg, 64).indexer  # one more copy of the indexer
    assert again == 2 * v32.tp_whole_matmul + training_flops(cfg, 64).indexer


@pytest.fixture
def small_gpu(tmp_path, monkeypatch):
    """A profile on which tiny-v3's default layout (no recompute, optimizer on the device) does not fit at 4
    devices, while a leaner one does."""
    (tmp_path / "small.toml").write_text(
        'name = "small"\nunit = "card"\npeak_tflops = { bf16 = 100.0 }\nmemory_gib = 0.012\nintra_node_gbps = 100\n'
        'inter_node_gbps = 10\ndevices_per_node = 4\nsource = "test"\n')
    monkeypatch.setenv("TREX_HARDWARE_DIR", str(tmp_path))
    return load_profiles()["small"]


@pytest.mark.parametrize("model", ["tiny-v3", "tiny-v4.1"])
def test_without_a_layout_the_plan_is_a_fitting_one_and_says_it_chose_it(small_gpu, capsys, model):
    from trex.parallel.mesh import resolve_layout

    assert not make_plan(get_preset(model), Layout(dp_shard=4), 256, small_gpu).fits  # what --devices alone would be
    args = ["plan", "--model", model, "--hardware", "small", "--devices", "4", "--seq", "256"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "FITS" in captured.out and "chosen      no recipe or --layout: the planner chose the fastest of" in captured.out
    assert "the planner chose" in captured.err
    assert main([*args, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["chosen"].startswith("no recipe or --layout")
    lay = out["layout"]  # one trex train runs
    assert resolve_layout(lay["dp_replicate"], lay["dp_shard"], lay["ep"], 4, lay["cp"], lay["tp"])


def test_the_search_offers_only_layouts_trex_train_runs_and_an_explicit_one_says_why_not(capsys):
    """trex train splits experts over ep / tp ranks of dp_shard x the tp ranks, never over cp
    (trex.parallel.mesh.check_expert_split); the planner can model ep over dp_shard x cp x tp (torchtitan's way). A
    search (the default plan, the nearest fitting, the fewest devices) keeps only what trex train runs; an explicit
    layout it cannot run yet still plans, with the reason."""
    from trex.parallel.mesh import resolve_layout

    every = search(TINY_V4, 4, 64, 4 * 64 * 2, H100, runnable_only=False)
    runnable = search(TINY_V4, 4, 64, 4 * 64 * 2, H100)
    assert any(p.layout.describe().startswith("dp_shard=2 ep=4 tp=2") for p in runnable)  # ep over dp_shard x tp
    assert [p.layout for p in runnable] == [p.layout for p in every if not p.layout.train_refusal()]
    for p in runnable:
        lay = p.layout
        assert lay.pp == 1 and resolve_layout(lay.dp_replicate, lay.dp_shard, lay.ep, lay.devices, lay.cp, lay.tp)
    assert main(["plan", "--model", "tiny", "--hardware", "h100-sxm", "--seq", "64", "--layout",
                 "dp_shard=1,ep=4,cp=2,tp=2"]) == 0
    assert ("note        trex train refuses it (parallel.ep = 4 spans the tp ranks: it must be tp (2) times a divisor "
            "of dp_shard (1)): ep=4 spans context-parallel ranks") in capsys.readouterr().out


def test_a_layout_that_does_not_fit_names_the_nearest_that_does(small_gpu, capsys):
    args = ["plan", "--model", "tiny-v3", "--hardware", "small", "--devices", "4", "--seq", "256", "--layout",
            "dp_shard=4,ep=4"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    line = next(s for s in out.splitlines() if s.startswith("nearest"))
    assert "the layout that fits with the fewest changes: dp_shard=" in line and "->" in line, line
    assert main([*args, "--format", "json"]) == 1
    near = json.loads(capsys.readouterr().out)["nearest_fitting"]
    assert near["changes"] and near["memory_bytes"] <= small_gpu.memory_gib * 2**30 * 0.9
    assert f"{near['layout']} (" in line
    fits = [p for p in search(TINY_V3, 4, 256, 4 * 256, small_gpu)]  # no fitting layout changes fewer choices
    assert min(len(_changes(p.layout)) for p in fits) == len(near["changes"])


def _changes(layout: Layout) -> list[str]:
    from trex.plan.planner import layout_changes

    return layout_changes(Layout(dp_shard=4, ep=4), layout)


# torchtitan-npu's published DeepSeek runs on Atlas 800T A3 (64 chips = 128 dies), each with its layout: AdamW with
# the moments in host memory (swap_optimizer), full recompute, one sequence per micro-batch, FSDP2 reduce-scattering
# every micro-batch (torchtitan accumulates without no-sync); its V3 and V3.2 models have no MTP module
# (num_mtp_modules 0; its V4 config sets 1), and its V3.2 trains the indexer (enable_indexer_loss, default on).
# docs/planning.md shows the table.
NO_MTP = "num_nextn_predict_layers=0"
PUBLISHED = [
    ("deepseek-v4-flash", 4096, 1024, "dp_shard=128,ep=128", "", 1056),
    ("deepseek-v3", 4096, 1024, "dp_shard=32,tp=4,ep=128", NO_MTP, 546),
    ("deepseek-v3.2", 4096, 512, "dp_shard=32,tp=4,ep=64,train_indexer=true", NO_MTP, 146),
    ("deepseek-v3.2", 32768, 128, "dp_shard=4,cp=8,tp=4,ep=64,train_indexer=true", NO_MTP, 103),
]
MISSES = {  # rows the planner does not reproduce within 15%: the ratio, and why (docs/planning.md)
    ("deepseek-v4-flash", 4096): "0.83: the EP all-to-all (ep=128, run again by the full recompute) over the "
                                 "profile's 25 GB/s RoCE between 16-die servers; 1.35 on one HCCS domain "
                                 "(ascend-910c-die-superpod): V4's kernels reach ~37% of peak, not the default 55%",
    ("deepseek-v3", 4096): "0.54: FSDP and EP traffic over RoCE alone exceed the published 60 s step; 0.81 on one "
                           "HCCS domain, where compute at the default 55% of peak already fills it",
    ("deepseek-v3.2", 4096): "1.28: communication-bound over RoCE at 88 s against the published 112 s (1.98 on one "
                             "HCCS domain with the indexer's training counted); the sparse kernels' share of the peak "
                             "is taken as the one default",
    ("deepseek-v3.2", 32768): "1.84: as the 4K row (2.44 on one HCCS domain)",
}


@pytest.mark.parametrize("model, seq, sequences, layout, override, published", PUBLISHED)
def test_the_published_runs_fit_and_land_within_15_percent(model, seq, sequences, layout, override, published):
    from trex.plan.command import parse_overrides
    from trex.plan.layout import parse_layout

    lay = parse_layout(layout, Layout(dp_shard=1, recompute="full", optimizer="adamw", offload_optimizer=True,
                                      reduce_every_micro_batch=True))
    lay = dataclasses.replace(lay, grad_accum=sequences // lay.data_parallel)
    assert lay.devices == 128
    cfg = dataclasses.replace(get_preset(model), **parse_overrides(override))
    plan = make_plan(cfg, lay, seq, DIE)
    assert plan.global_batch_tokens == sequences * seq
    assert plan.fits  # every published layout fits under the planner's memory model
    within = abs(plan.tokens_per_s_per_device / published - 1) <= 0.15
    if (model, seq) in MISSES:  # a known miss (docs/planning.md); one that lands must leave MISSES
        assert not within, f"{model} now lands within 15% ({plan.tokens_per_s_per_device:.0f}): drop it from MISSES"
        pytest.xfail(MISSES[model, seq])
    assert within, plan.tokens_per_s_per_device


def test_override_changes_the_planned_model_and_a_bad_one_is_one_line(capsys):
    args = ["plan", "--model", "tiny-v3", "--hardware", "h100-sxm", "--seq", "64", "--layout", "dp_shard=2,ep=2",
            "--format", "json"]
    assert main(args) == 0
    with_mtp = json.loads(capsys.readouterr().out)["parameters"]
    assert main([*args, "--override", NO_MTP]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["mtp"] == 0 < with_mtp["mtp"]
    assert main([*args[:-2], "--override", "num_nextn_predict_layers"]) == 2
    err = capsys.readouterr().err
    assert "--override: cannot read 'num_nextn_predict_layers'; expected FIELD=VALUE" in err and err.count("\n") == 1


def test_the_notes_say_which_expert_splits_trex_train_runs_under_tp():
    """trex train splits the experts over ep / tp ranks of dp_shard x the tp ranks (the published V3-671B layout runs
    as planned: no note), never over cp ranks or a part of a tp group (trex.parallel.mesh.check_expert_split's
    line in the note); ep = 1 leaves every expert on every tp rank, which the planner does not model."""
    def refusals(layout: Layout) -> list[str]:
        return [n for n in make_plan(TINY_V3, layout, 64, H100).notes
                if "trex train" in n and ("expert" in n or "ep=" in n)]

    assert refusals(Layout(dp_shard=2, ep=4, tp=2)) == [] and refusals(Layout(dp_shard=2, ep=2, tp=2)) == []
    assert refusals(Layout(dp_shard=1, ep=4, cp=2, tp=2)) == [
        "trex train refuses it (parallel.ep = 4 spans the tp ranks: it must be tp (2) times a divisor of dp_shard (1)): "
        "ep=4 spans context-parallel ranks or a part of the tp ranks, as torchtitan may place experts "
        "(expert_tensor_parallel_degree = 1)"]
    assert refusals(Layout(dp_shard=2, tp=2))[0].startswith("tp > 1, ep = 1: ")
