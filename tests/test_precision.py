"""Precision policy resolution, dynamic loss scaling and the non-finite step guard."""

import logging

import pytest
import torch

from trex import device
from trex.precision import DynamicLossScaler, NonFiniteError, PrecisionSection, PrecisionPolicy, StepGuard
from trex.train.optim import OptimSection, build_optimizer, clip_grad_norm


def fake_caps(monkeypatch, **caps):
    full = dict(bf16=True, bf16_fast=True, fp16=True, fp8=False) | caps
    monkeypatch.setattr(device, "_capabilities", lambda dev_type, index: device.Capabilities(**full))


def test_auto_is_fp32_on_cpu_and_bf16_on_fast_accelerators(monkeypatch):
    fake_caps(monkeypatch, bf16_fast=True)
    cpu = PrecisionPolicy.resolve("auto", device.Device("cpu"))
    assert cpu.name == "fp32" and cpu.param_dtype == torch.float32 and not cpu.loss_scaling
    acc = PrecisionPolicy.resolve("auto", device.Device("cuda", 0))
    assert acc.compute_dtype == torch.bfloat16
    assert acc.param_dtype == acc.master_dtype == acc.reduce_dtype == torch.float32
    fake_caps(monkeypatch, bf16_fast=False)
    assert PrecisionPolicy.resolve("auto", device.Device("npu", 0)).name == "fp32"


def test_forced_bf16_warns_only_where_slow(monkeypatch, caplog):
    fake_caps(monkeypatch, bf16_fast=False)
    with caplog.at_level(logging.WARNING, logger="trex"):
        policy = PrecisionPolicy.resolve("bf16", device.Device("cpu"))
    assert any("bf16 matmul measured slower" in r.getMessage() for r in caplog.records)
    assert policy.compute_dtype == torch.bfloat16 and policy.param_dtype == torch.float32
    fake_caps(monkeypatch, bf16_fast=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trex"):
        PrecisionPolicy.resolve("bf16", device.Device("cpu"))
    assert not caplog.records


def test_missing_dtype_support_is_an_error(monkeypatch):
    fake_caps(monkeypatch, fp16=False)
    with pytest.raises(ValueError, match="fp16 was requested"):
        PrecisionPolicy.resolve("fp16", device.Device("xpu", 0))
    with pytest.raises(ValueError, match="precision.dtype"):
        PrecisionPolicy.resolve("int8", device.Device("cpu"))


def test_fp16_policy_record():
    policy = PrecisionPolicy.resolve("fp16", device.Device("cpu"))
    assert policy.to_dict() == {"name": "fp16", "param_dtype": "float32", "compute_dtype": "float16",
                                "master_dtype": "float32", "reduce_dtype": "float32", "loss_scaling": True}


def test_loss_scaler_backoff_growth_and_state():
    s = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, growth_interval=3, backoff_factor=0.5, min_scale=2.0)
    assert s.scale(torch.tensor(1.5)).item() == 12.0
    s.update(found_inf=True)
    assert s.scale_value == 4.0
    s.update(found_inf=True)
    s.update(found_inf=True)
    assert s.scale_value == 2.0 and not s.can_back_off()  # clamped at min_scale
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale_value == 4.0
    s.update(found_inf=False)
    twin = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    twin.load_state_dict(s.state_dict())
    assert (twin.scale_value, twin.clean_steps) == (4.0, 1)
    off = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert off.scale(loss) is loss and off.scale_value == 1.0


def test_unscale_divides_gradients():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([8.0, -16.0, 4.0])
    DynamicLossScaler(init_scale=4.0).unscale_([p])
    assert p.grad.tolist() == [2.0, -4.0, 1.0]


def fp16_step(model, opt, scaler, guard, x, step, inject=None):
    """One loop iteration as the training loop runs it."""
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if inject is not None:
        model.weight.grad.view(-1)[0] = inject
    scaler.unscale_(model.parameters())
    norm = clip_grad_norm(model.parameters(), 1.0)
    finite = guard.finite(loss, norm)
    opt.step(apply=finite.all())  # on the device: a non-finite step changes nothing
    guard.record(*finite.tolist(), step)
    opt.zero_grad(set_to_none=True)


def check(guard, loss, norm, step):
    """The guard's two halves back to back, as the loop runs them around its one read."""
    return guard.record(*StepGuard.finite(loss, norm).tolist(), step)


def test_injected_inf_and_nan_skip_the_step_and_leave_weights_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False).to(torch.float16)
    opt = build_optimizer(model, OptimSection(name="adamw", lr=1e-2))
    scaler = DynamicLossScaler(init_scale=1024.0)
    guard = StepGuard(max_consecutive=3, scaler=scaler)
    x = torch.randn(4, 8, dtype=torch.float16)
    before = model.weight.detach().clone()
    fp16_step(model, opt, scaler, guard, x, 0, inject=float("inf"))
    assert torch.equal(model.weight, before) and scaler.scale_value == 512.0
    assert opt.state[model.weight]["step"] == 0 and not opt.state[model.weight]["exp_avg"].any()
    assert guard.skipped_total == 1 and guard.consecutive == 0  # the scaler can still back off
    assert "loss scale 1024 -> 512" in guard.last_reason
    fp16_step(model, opt, scaler, guard, x, 1, inject=float("nan"))
    assert torch.equal(model.weight, before) and guard.skipped_total == 2
    fp16_step(model, opt, scaler, guard, x, 2)
    assert not torch.equal(model.weight, before) and guard.skipped_total == 2
    assert torch.isfinite(opt.state[model.weight]["master"]).all()


def test_consecutive_non_finite_losses_stop_the_run():
    guard = StepGuard(max_consecutive=3)
    ok = torch.tensor(1.0)
    nan = torch.tensor(float("nan"))
    assert not check(guard, nan, ok, 10)
    assert check(guard, ok, ok, 11) and guard.consecutive == 0  # a good step resets the run of skips
    assert not check(guard, ok, torch.tensor(float("inf")), 12)
    assert not check(guard, nan, ok, 13)
    with pytest.raises(NonFiniteError, match=r"step 14: non-finite loss: 3 consecutive steps skipped"):
        check(guard, nan, ok, 14)
    assert guard.skipped_total == 4


def test_fp16_overflow_at_min_scale_counts_toward_the_limit():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    guard = StepGuard(max_consecutive=2, scaler=scaler)
    ok, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    assert not check(guard, ok, inf, 0) and not check(guard, ok, inf, 1)  # 4 -> 2 -> 1: remediable
    assert guard.consecutive == 0 and scaler.scale_value == 1.0
    assert not check(guard, ok, inf, 2)
    with pytest.raises(NonFiniteError, match="max_consecutive_skips = 2"):
        check(guard, ok, inf, 3)
    state = guard.state_dict()
    resumed = StepGuard(max_consecutive=2, scaler=DynamicLossScaler(init_scale=4.0))
    resumed.load_state_dict(state)
    assert (resumed.skipped_total, resumed.consecutive, resumed.scaler.scale_value) == (4, 2, 1.0)


def test_precision_config_validation():
    with pytest.raises(ValueError, match="precision.dtype"):
        PrecisionSection(dtype="fp8")
    with pytest.raises(ValueError, match="precision.backoff_factor"):
        PrecisionSection(backoff_factor=1.5)
    cfg = PrecisionSection(dtype="fp16", init_scale=128.0)
    scaler = DynamicLossScaler.from_config(cfg, PrecisionPolicy.resolve("fp16", device.Device("cpu")))
    assert scaler.enabled and scaler.scale_value == 128.0
    assert not DynamicLossScaler.from_config(cfg, PrecisionPolicy.resolve("fp32", device.Device("cpu"))).enabled


# ---- one process, low precision: fp32 master parameters, compute in the policy dtype ----------------
def _tiny_pair(dtype):
    """A tiny model with fp32 parameters cast for compute, and a twin holding the same values in ``dtype``."""
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.parallel.plan import cast_for_compute

    model = build_model(tiny(), seed=0)
    twin = build_model(tiny(), seed=0)
    for p in twin.parameters():
        p.data = p.data.to(dtype)
    cast_for_compute(model, dtype)
    return model, twin


def _batch(seed):
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def _backward(model, ids):
    out = model(ids, labels=ids)
    (out.loss + out.mtp_loss).backward()
    return out


def test_cast_for_compute_runs_the_low_precision_model_on_fp32_masters():
    model, twin = _tiny_pair(torch.bfloat16)
    params = list(model.parameters())
    out, ref = _backward(model, _batch(0)), _backward(twin, _batch(0))
    assert torch.equal(out.logits, ref.logits) and out.loss.item() == ref.loss.item()  # computed in bf16
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    assert sum(p.grad is not None for p in params) > len(params) // 2
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32, name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:  # the bf16 gradient, delivered in fp32
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float()), name


def test_micro_batch_gradients_accumulate_in_fp32():
    model, twin = _tiny_pair(torch.bfloat16)
    for seed in (0, 1):
        _backward(model, _batch(seed))
    single = []
    for seed in (0, 1):
        twin.zero_grad(set_to_none=True)
        _backward(twin, _batch(seed))
        single.append([q.grad.float() for q in twin.parameters() if q.grad is not None])
    exact = [a + b for a, b in zip(*single)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(exact) and all(torch.equal(g, e) for g, e in zip(grads, exact))
    rounded = [(a + b).to(torch.bfloat16).float() for a, b in zip(*single)]
    assert any(not torch.equal(g, r) for g, r in zip(exact, rounded))  # a bf16 sum would differ


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_see_the_same_low_precision_weights(mode):
    from trex.parallel.plan import apply_activation_checkpointing

    plain, _ = _tiny_pair(torch.bfloat16)
    recomputed, _ = _tiny_pair(torch.bfloat16)
    apply_activation_checkpointing(recomputed, mode)
    a, b = _backward(plain, _batch(0)), _backward(recomputed, _batch(0))
    assert torch.equal(a.logits, b.logits)
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name


def test_fp32_installs_nothing_and_a_later_fp32_stage_removes_the_cast():
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.parallel.plan import cast_for_compute

    model = build_model(tiny(), seed=0)
    reference = model(_batch(0)).logits
    cast_for_compute(model, torch.float32)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    cast_for_compute(model, torch.bfloat16)
    assert not torch.equal(model(_batch(0)).logits, reference)
    cast_for_compute(model, torch.float32)  # a job's next stage at fp32
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.equal(model(_batch(0)).logits, reference)


def test_at_identical_weights_the_mhc_gradients_in_bf16_agree_with_fp32():
    """Issue 53: the mHC groups' gradient norms depart by ~100% between bf16 runs of the fidelity
    recipe. At identical weights and batch they agree with fp32 (measured on the recipe: within 1.2%;
    `hc_head`, a tiny share of the gradient, within 12%), so that departure is the trajectory's
    (docs/fidelity.md), not a precision loss in the mHC backward (Sinkhorn, collapse, expand). Here
    they agree within 0.3%; even the mixes GEMM planted in bf16 stays under 1%, the Sinkhorn backward
    rounded to bf16 at every normalisation under 0.3%: a lost gradient path, not bf16, fails this."""
    from trex.models import build_model
    from trex.models.deepseek_v4.config import tiny
    from trex.parallel.plan import cast_for_compute
    from trex.train.signals import grad_norms_by_group

    norms = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(tiny(), seed=0)
        cast_for_compute(model, dtype)
        _backward(model, _batch(0))
        norms[dtype] = grad_norms_by_group(model)
    hc = [g for g in norms[torch.float32] if g.endswith(".hc")]
    errors = {g: abs(norms[torch.bfloat16][g] - norms[torch.float32][g]) / norms[torch.float32][g] for g in hc}
    assert len(hc) >= 3 and max(errors.values()) < 0.02, errors
