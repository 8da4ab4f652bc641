"""Muon + AdamW optimizer, grouping rules, gradient clipping and LR schedules."""

import copy
import math

import pytest
import torch

from trex.models import build_model
from trex.models.deepseek_v4.config import tiny
from trex.train.moe_balance import freeze_indexer
from trex.train.optim import (OptimSection, build_optimizer, classify, clip_grad_norm, hybrid_newton_schulz, ns_flops,
                              orthogonalized_update)
from trex.train.schedule import ScheduleSection, build_scheduler, lr_multiplier

# The report's hybrid schedule, written out here independently of OptimSection's defaults.
PAPER_NS = [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2
PAPER_NS_SCHEDULE = [(3.4445, -4.7750, 2.0315, 8), (2.0, -1.5, 0.5, 2)]


# ---- a straightforward reference: one matrix at a time, plain loops ------------------------------
def ref_newton_schulz(G: torch.Tensor) -> torch.Tensor:
    X = G.double()
    X = X / X.pow(2).sum().sqrt()
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    for a, b, c in PAPER_NS:
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.T if transposed else X


def ref_row_slices(name: str, shape: torch.Size, cfg) -> list[slice]:
    """The logical matrices of a 2-D slice, decided from the parameter name and the model config."""
    n, rows = cfg.hc_mult, shape[-2]
    if name.endswith(("hc_attn.fn", "hc_ffn.fn")):
        return [slice(0, n), slice(n, 2 * n), slice(2 * n, 2 * n + n * n)]
    csa_layer = name.startswith("layers.") and cfg.layer_types[int(name.split(".")[1])] == "compressed_sparse_attention"
    if csa_layer and ("compressor.wkv" in name or "compressor.wgate" in name):
        return [slice(0, rows // 2), slice(rows // 2, rows)]
    if name.endswith("attn.wo_a.weight"):
        r = cfg.o_lora_rank
        return [slice(i * r, (i + 1) * r) for i in range(cfg.o_groups)]
    return [slice(0, rows)]


def ref_muon_step(name, W, G, M, cfg_model, lr, wd, mu=0.95, rms=0.18):
    """Returns the new W and M; W, G, M: fp64 tensors, 2-D or stacked experts [E, out, in]."""
    M = mu * M + G
    X = mu * M + G
    O = torch.zeros_like(W)
    mats = [(e,) for e in range(W.shape[0])] if W.dim() == 3 else [()]
    for idx in mats:
        for rows in ref_row_slices(name, W.shape, cfg_model):
            block = X[idx][rows]
            O[idx][rows] = ref_newton_schulz(block) * math.sqrt(max(block.shape)) * rms
    return W * (1 - lr * wd) - lr * O, M


def test_muon_matches_reference_on_tiny_model():
    torch.manual_seed(0)
    cfg = tiny(n_routed_experts=4)
    model = build_model(cfg, seed=0)
    lr, wd = 0.02, 0.1
    opt = build_optimizer(model, OptimSection(lr=lr, weight_decay=wd))
    muon = {n: p for n, p, rule, _ in classify(model) if rule.muon}
    ref_W = {n: p.detach().double().clone() for n, p in muon.items()}
    ref_M = {n: torch.zeros_like(w) for n, w in ref_W.items()}
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for n, p in muon.items():
            ref_W[n], ref_M[n] = ref_muon_step(n, ref_W[n], p.grad.double(), ref_M[n], cfg, lr, wd)
        opt.step()
    kinds = set()
    for n, p in muon.items():
        torch.testing.assert_close(p.detach().double(), ref_W[n], rtol=0, atol=2e-6, msg=n)
        kinds.add(len(ref_row_slices(n, p.shape, cfg)) + 100 * (p.dim() == 3))
    assert kinds >= {1, 2, 3, cfg.o_groups, 101}  # whole, halves, mHC split, wo_a groups, experts all exercised


def test_split_changes_the_update():
    """Orthogonalising the stacked mHC fn whole would give a different update than per-block."""
    torch.manual_seed(1)
    g = torch.randn(24, 256)
    split = orthogonalized_update(g, [4, 4, 16], 0.18, PAPER_NS_SCHEDULE)
    whole = orthogonalized_update(g, [], 0.18, PAPER_NS_SCHEDULE)
    assert (split - whole).abs().max() > 0.05
    for rows in (slice(0, 4), slice(4, 8), slice(8, 24)):  # each block is itself orthogonal
        blk = split[rows] / (math.sqrt(256) * 0.18)
        torch.testing.assert_close(blk @ blk.T, torch.eye(blk.shape[0]), atol=2e-3, rtol=0)


@pytest.mark.parametrize("shape", [(64, 64), (16, 128), (200, 24), (3, 5, 40)])
def test_newton_schulz_orthogonalises_and_update_has_target_rms(shape):
    torch.manual_seed(2)
    x = torch.randn(shape)
    o = hybrid_newton_schulz(x, PAPER_NS_SCHEDULE)
    sv = torch.linalg.svdvals(o)
    assert sv.min() > 0.99 and sv.max() < 1.01
    u = orthogonalized_update(x, [], 0.18, PAPER_NS_SCHEDULE)
    assert u.pow(2).mean().sqrt().item() == pytest.approx(0.18, rel=0.01)


def test_newton_schulz_bf16_close_to_fp32():
    torch.manual_seed(3)
    x = torch.randn(32, 96)
    o32 = hybrid_newton_schulz(x, PAPER_NS_SCHEDULE, torch.float32)
    o16 = hybrid_newton_schulz(x, PAPER_NS_SCHEDULE, torch.bfloat16)
    assert (o16 - o32).norm() / o32.norm() < 0.05


def test_bad_row_blocks_are_rejected():
    with pytest.raises(ValueError, match="row_blocks"):
        orthogonalized_update(torch.randn(10, 8), [4, 4], 0.18, PAPER_NS_SCHEDULE)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(4)
    model = build_model(tiny(), seed=0)
    cfg = OptimSection(name="adamw", lr=1e-2, eps=1e-8, decay_gains_and_biases=True)
    ours = build_optimizer(model, cfg)
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_grouping_rules_on_tiny_model():
    cfg = tiny()
    model = build_model(cfg)
    rules = {n: (rule.key, blocks) for n, _, rule, blocks in classify(model)}
    assert set(rules) == {n for n, _ in model.named_parameters()}
    assert rules["embed.weight"][0] == rules["head.weight"][0] == "embed_head"
    for n in ("layers.0.attn_norm.weight", "layers.1.attn.attn_sink", "layers.1.attn.compressor.ape",
              "layers.0.hc_attn.base", "layers.0.hc_ffn.scale", "hc_head.base", "mtp.0.enorm.weight"):
        assert rules[n] == ("gains_biases", []), n
    assert rules["layers.0.hc_attn.fn"] == ("mhc_fn", [4, 4, 16])
    assert rules["hc_head.fn"] == ("matrix", [])
    c, ci = cfg.head_dim, cfg.index_head_dim
    assert rules["layers.1.attn.compressor.wkv.weight"] == ("csa_halves", [c, c])  # CSA layer
    assert rules["layers.1.attn.indexer.compressor.wgate.weight"] == ("csa_halves", [ci, ci])
    assert rules["layers.2.attn.compressor.wkv.weight"] == ("matrix", [])  # HCA: no overlap, one matrix
    assert rules["layers.3.attn.wo_a.weight"] == ("wo_a_groups", [cfg.o_lora_rank] * cfg.o_groups)
    assert rules["layers.3.ffn.experts.w2"] == ("experts", [])
    assert rules["layers.3.ffn.gate.weight"] == ("matrix", [])


def test_grouping_rules_of_v41_and_v3_come_from_their_modules():
    """The rules each family's modules declare (optimizer_rules), not family classes named in the optimizer:
    V4.1's Engram (row-wise tables, gains), its grouped output projection and mHC; V3's experts, and its
    MLA projections whole (as Moonlight trains them)."""
    from trex.models.deepseek_v3.config import tiny_v3
    from trex.models.deepseek_v4.config_v41 import tiny_v41

    cfg = tiny_v41()
    rules = {n: (rule.key, blocks) for n, _, rule, blocks in classify(build_model(cfg))}
    engram = next(n.split(".engram.")[0] for n in rules if ".engram." in n)
    assert rules[f"{engram}.engram.embed.weight"] == ("engram_table", [])
    assert rules[f"{engram}.engram.q_weight"] == rules[f"{engram}.engram.k_weight"] == ("gains_biases", [])
    assert rules["layers.0.attn.wo_a.weight"] == ("wo_a_groups", [cfg.o_lora_rank] * cfg.o_groups)
    assert rules["layers.0.hc_attn.fn"] == ("mhc_fn", [cfg.hc_mult, cfg.hc_mult, cfg.hc_mult ** 2])
    assert rules["layers.0.ffn.experts.w1"] == ("experts", [])
    rules = {n: (rule.key, blocks) for n, _, rule, blocks in classify(build_model(tiny_v3()))}
    assert {k for k, _ in rules.values()} == {"matrix", "gains_biases", "experts", "embed_head"}
    assert rules["layers.1.attn.wkv_a.weight"] == rules["layers.1.attn.wkv_b.weight"] == ("matrix", [])
    assert rules["mtp.0.ffn.experts.w3"] == ("experts", [])


def test_a_module_declares_its_rules_and_an_unknown_rule_is_refused_naming_it():
    """The interface a new family fills: a module's optimizer_rules() decides its parameters' rules (row blocks
    included); what it does not name takes the default by kind and shape; a rule that does not exist is
    refused with the module, its path and the rule."""
    class Part(torch.nn.Module):
        def __init__(self, rule="csa_halves"):
            super().__init__()
            self.rule = rule
            self.w = torch.nn.Parameter(torch.zeros(4, 3))
            self.v = torch.nn.Parameter(torch.zeros(4, 3))
            self.g = torch.nn.Parameter(torch.ones(3))

        def optimizer_rules(self):
            return {"w": (self.rule, [2, 2])}

    model = torch.nn.Module()
    model.embed, model.part = torch.nn.Embedding(5, 3), Part()
    rules = {n: (rule.key, blocks) for n, _, rule, blocks in classify(model)}
    assert rules == {"embed.weight": ("embed_head", []), "part.w": ("csa_halves", [2, 2]),
                     "part.v": ("matrix", []), "part.g": ("gains_biases", [])}
    model.part = Part("halves")
    with pytest.raises(ValueError, match=r"Part \(part\) names rule 'halves' for w; expected one of"):
        classify(model)


def test_optimizer_groups_frozen_params_and_adamw_mode():
    model = build_model(tiny())
    frozen = set(freeze_indexer(model))
    opt = build_optimizer(model, OptimSection(weight_decay=0.1))
    in_opt = {n for g in opt.param_groups for n in g["names"]}
    assert frozen and not (frozen & in_opt)
    by_rule = {g["rule"]: g for g in opt.param_groups}
    assert by_rule["gains_biases"]["weight_decay"] == 0.0 and by_rule["embed_head"]["weight_decay"] == 0.1
    assert {g["algorithm"] for r, g in by_rule.items() if r in ("embed_head", "gains_biases")} == {"adamw"}
    assert {g["algorithm"] for r, g in by_rule.items() if r not in ("embed_head", "gains_biases")} == {"muon"}
    assert by_rule["matrix"]["ns_dtype"] == "fp32"  # auto on CPU
    text = opt.describe_groups()
    for rule in by_rule:
        assert f"[{rule}]" in text
    assert "layers.*.ffn.experts.w1  x4" in text
    all_adamw = build_optimizer(build_model(tiny()), OptimSection(name="adamw"))
    assert {g["algorithm"] for g in all_adamw.param_groups} == {"adamw"}


def test_bf16_params_keep_fp32_master_across_checkpoint():
    torch.manual_seed(5)
    model = build_model(tiny(), seed=0, dtype=torch.bfloat16)
    opt = build_optimizer(model, OptimSection(lr=1e-3))
    twin = copy.deepcopy(model)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(4)]

    def step(m, o, gs):
        for p, g in zip(m.parameters(), gs):
            p.grad = g.clone()
        o.step()

    for gs in grads[:2]:
        step(model, opt, gs)
    saved = copy.deepcopy(opt.state_dict())
    resumed = build_optimizer(twin, OptimSection(lr=1e-3))
    for p, q in zip(model.parameters(), twin.parameters()):
        q.data.copy_(p.data)
    resumed.load_state_dict(saved)
    for gs in grads[2:]:
        step(model, opt, gs)
        step(twin, resumed, gs)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert opt.state[p]["master"].dtype == torch.float32, n
        assert resumed.state[q]["master"].dtype == torch.float32, n
        torch.testing.assert_close(opt.state[p]["master"], resumed.state[q]["master"], rtol=0, atol=0, msg=n)
        assert torch.equal(p, opt.state[p]["master"].to(torch.bfloat16)), n


def test_clip_grad_norm_reports_norm_and_clips():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert clip_grad_norm([a, b], 0).item() == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0  # measure only
    assert clip_grad_norm([a, b], 1.0).item() == pytest.approx(5.0)
    assert torch.cat([a.grad, b.grad.flatten()]).norm().item() == pytest.approx(1.0, rel=1e-4)
    a.grad[1] = float("inf")
    assert not torch.isfinite(clip_grad_norm([a, b], 1.0))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="optim.name"):
        OptimSection(name="sgd")
    with pytest.raises(ValueError, match="optim.ns_iterations"):
        OptimSection(ns_iterations=[8])
    with pytest.raises(ValueError, match="schedule.decay"):
        ScheduleSection(decay="step")


# ---- schedules --------------------------------------------------------------------------------------
def test_warmup_then_cosine():
    cfg = ScheduleSection(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    T = 14
    f = [lr_multiplier(s, T, cfg) for s in range(T)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(x >= y for x, y in zip(f[4:], f[5:]))
    mid = 4 + (T - 4 - 1) / 2  # halfway through decay: cos(pi/2) = 0
    assert lr_multiplier(int(mid), T, cfg) > 0.55 > lr_multiplier(int(mid) + 1, T, cfg)


def test_linear_and_constant_decay():
    lin = ScheduleSection(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert [lr_multiplier(s, 5, lin) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    const = ScheduleSection(warmup_steps=2, decay="constant")
    assert [lr_multiplier(s, 5, const) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])


def test_scheduler_drives_every_group():
    model = build_model(tiny())
    opt = build_optimizer(model, OptimSection(lr=1e-3))
    sched = build_scheduler(opt, ScheduleSection(warmup_steps=2, decay="linear", min_lr_ratio=0.5), total_steps=4)
    seen = []
    for _ in range(4):
        seen.append({g["lr"] for g in opt.param_groups})
        opt.step()
        sched.step()
    assert [s.pop() for s in seen] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])  # peak: last warmup and first decay step
    with pytest.raises(ValueError, match="warmup_steps"):
        build_scheduler(opt, ScheduleSection(warmup_steps=10), total_steps=4)


def test_transposing_tall_matrices_does_not_change_the_result():
    """The [?] in the reference: iterating on the tall matrix itself gives the same result."""
    torch.manual_seed(6)
    X = torch.randn(48, 12, dtype=torch.float64)
    Y = X / X.norm()
    for a, b, c in PAPER_NS:  # Gram matrix 48 x 48, no transpose
        A = Y @ Y.T
        Y = a * Y + b * (A @ Y) + c * (A @ (A @ Y))
    torch.testing.assert_close(Y, ref_newton_schulz(X))
    torch.testing.assert_close(hybrid_newton_schulz(X.float(), PAPER_NS_SCHEDULE), Y.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_training_on_one_batch_lowers_the_loss(name):
    torch.manual_seed(7)
    model = build_model(tiny(), seed=0)
    opt = build_optimizer(model, OptimSection(name=name, lr=3e-3))
    ids = torch.randint(0, 256, (2, 32))
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


# ---- Muon on sharded parameters: two gloo ranks (tests/muon_owner_worker.py) ---------------------------
@pytest.fixture(scope="module")
def sharded_muon(tmp_path_factory):
    """Each rank's record of two Muon steps of the tiny model under FSDP2 x EP 2, and of three
    hand-sharded matrices, with one process's gradients."""
    import json
    import os

    from test_distributed import ROOT
    from trex_run import torchrun

    out = tmp_path_factory.mktemp("muon_owner")
    worker = os.path.join(ROOT, "tests", "muon_owner_worker.py")
    proc = torchrun(worker, [str(out)])  # each rank forked from a warm process
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_sharded_muon_update_is_one_processs_bitwise(sharded_muon):
    """The owner orthogonalises the same full matrix one process would (gathered shards are the same
    elementwise momentum), so every Muon parameter, every layout, equals one process's bit for bit."""
    assert sharded_muon[0]["mismatched"] == []  # [name, max |difference|] of each parameter that differs
    assert all(r["syncs"] == 0 for r in sharded_muon)


def test_sharded_muon_runs_newton_schulz_once_per_matrix(sharded_muon):
    """A matrix FSDP splits is orthogonalised by its owner only, each matrix by exactly one rank, the
    owners' loads balanced; a stack of experts split over EP (FSDP's strided shard on top) by each
    rank for its own experts only, as is a hand-made stack split on its rows by its owner."""
    owned = [sorted(map(tuple, r["owned"])) for r in sharded_muon]
    for r, mine in zip(sharded_muon, owned):
        assert sorted(map(tuple, r["ns_calls"])) == sorted(2 * (mine + [tuple(s) for s in r["stacks"]]))  # 2 steps
        assert r["experts"][0] == 2  # 4 experts over EP 2
        assert all(s[0] == 2 for s in r["stacks"])  # only the local experts, not all 4
    assert len(owned[0]) + len(owned[1]) == sharded_muon[0]["owner_path"]
    assert {(5, 12), (12, 5), (3, 8, 6)} <= set(owned[0]) | set(owned[1])
    loads = [sum(ns_flops(s, [], 10) for s in mine) for mine in owned]
    assert max(loads) < 1.25 * min(loads), loads


# ---- Muon under FSDP2 x TP: four gloo ranks (tests/muon_tp_worker.py) ----------------------------------
@pytest.mark.slow
def test_muon_under_fsdp2_x_tp_gathers_2d_matrices_without_dtensor_warnings(tmp_path):
    """tiny-v3 at dp_shard = 2 x tp = 2 (experts over ep = 4): a column-wise weight is a 2-D DTensor (TP's rows split again by FSDP2: a
    ``_StridedShard`` on the fsdp dim), which Muon orthogonalises whole on every rank. Gathered one mesh dim at a
    time in the order DTensor can (trex.parallel.parameter_view.full_tensor), no rank logs DTensor's warning
    about sequential all_gathers (``full_tensor()`` logged it once on each rank: "While redistributing from
    (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate(), Replicate()), 2
    sequential all_gather operations will be performed ... it is not possible to merge non-ascending order
    all_gather operations"), and after two steps every Muon parameter is one process's bit for bit: the
    orthogonalised update is the one computed from the whole matrix. Every parameter of the layout (experts too)
    gathers as DTensor's ``full_tensor`` gathers it."""
    import json
    import os

    from test_distributed import ROOT
    from trex_run import torchrun

    proc = torchrun(os.path.join(ROOT, "tests", "muon_tp_worker.py"), [str(tmp_path)], nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" in ranks[0]["gathered"]
    assert ranks[0]["mismatched"] == []
    assert [r["logged"] for r in ranks] == [[]] * 4
    assert [r["differing_gathers"] for r in ranks] == [[]] * 4  # every parameter's placements gathered alike
