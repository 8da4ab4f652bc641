"""trex_vdev, the virtual accelerator registered through PrivateUse1.

Registering PrivateUse1 is process-global and irreversible, so every check runs in a child
process (``python -c``, forked from a warm process that has not imported it either); this process never
imports trex_vdev. Each child runs a group of named
checks and prints their results as JSON, and the tests below assert on them one by one.
"""

from __future__ import annotations

import functools
import json
import pathlib
import socket
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs in the child before the checks: registration, a check harness, small helpers.
PRELUDE = """
import json, sys, traceback, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
import trex_vdev
from trex_vdev import cpu_data
RESULTS = {}
def check(fn):
    try:
        out = fn()
        RESULTS[fn.__name__] = {"ok": True, "value": out}
    except Exception as e:  # reported, asserted in the parent
        RESULTS[fn.__name__] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc()[-2000:]}
    return fn
def same(a, b):
    return bool(torch.equal(cpu_data(a).cpu() if a.device.type != "cpu" else a, b))
"""

EPILOGUE = """
print("@@RESULTS@@" + json.dumps(RESULTS, default=str))
"""


def run_child(body: str, env: dict | None = None, timeout: int = 300) -> dict:
    """The checks in ``body`` in a child process forked from a warm one that has not imported trex_vdev
    (tests/trex_run.py ``python``: ``python -c`` without ~3 CPU seconds of start-up); their results."""
    from trex_run import python

    code = PRELUDE + textwrap.dedent(body) + EPILOGUE
    proc = python(code, env={"PYTHONPATH": str(ROOT / "src"), **(env or {})}, cwd=str(ROOT), timeout=timeout)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULTS@@")]
    assert proc.returncode == 0 and marker, f"child failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(marker[-1][len("@@RESULTS@@"):])


def ok(results: dict, name: str):
    r = results[name]
    assert r["ok"], f"{name}: {r['error']}\n{r.get('trace', '')}"
    return r["value"]


# ---- registration, device module, torch.accelerator ------------------------------------------------
@functools.lru_cache(maxsize=None)
def core_results() -> dict:
    return run_child("""
    @check
    def accelerator():
        return [torch.accelerator.is_available(), str(torch.accelerator.current_accelerator()),
                torch.accelerator.device_count(), torch.accelerator.current_device_index(),
                torch._C._get_privateuse1_backend_name()]

    @check
    def register_is_idempotent():
        trex_vdev.register(); trex_vdev.register()
        return trex_vdev.is_registered()

    @check
    def device_module():
        m = torch.get_device_module("vdev")
        props = m.get_device_properties(0)
        m.synchronize(); m.synchronize(0)
        torch.accelerator.synchronize()
        return [m is torch.vdev, m.is_available(), m.device_count(), m.current_device(), props.name,
                props.total_memory > 0, m.is_bf16_supported(), m.get_rng_state().dtype == torch.uint8]

    @check
    def memory_accounting():
        m = torch.vdev
        base = m.memory_allocated(0)
        x = torch.empty(1000, device="vdev")            # 4000 bytes
        v, d = x[10:], x.detach()                     # views: counted once
        with_x = m.memory_allocated(0) - base
        m.reset_peak_memory_stats(0)
        y = torch.empty(250, device="vdev")             # 1000 bytes more
        peak = m.max_memory_allocated(0) - base
        del x, v, d, y
        return [with_x, peak, m.memory_allocated(0) - base, torch.accelerator.memory_allocated() - base]

    @check
    def rng_is_the_cpu_generator():
        torch.vdev.manual_seed(7); a = torch.randn(100, device="vdev")
        torch.manual_seed(7); b = torch.randn(100)
        state = torch.vdev.get_rng_state(0); c = torch.rand(5, device="vdev")
        torch.vdev.set_rng_state(state, 0); d = torch.rand(5, device="vdev")
        g = torch.Generator(device="vdev").manual_seed(3)
        e = torch.randn(50, device="vdev", generator=g)
        f = torch.randn(50, generator=torch.Generator().manual_seed(3))
        torch.manual_seed(1); p = torch.nn.functional.dropout(torch.ones(500, device="vdev"), 0.3)
        torch.manual_seed(1); q = torch.nn.functional.dropout(torch.ones(500), 0.3)
        return [same(a, b), same(c, d.cpu()), str(g.device), isinstance(g, torch.Generator), same(e, f),
                same(p, q)]

    @check
    def factories():
        return [type(torch.zeros(2, 3, device="vdev")).__name__,
                str(torch.empty(2, device="vdev").device),
                torch.ones(2, device="vdev").tolist(),
                torch.full((2,), 3.5, device="vdev").tolist(),
                torch.arange(5, device="vdev").tolist(),
                torch.eye(2, device="vdev").tolist(),
                torch.tensor([1, 2], device="vdev").tolist(),
                torch.as_tensor([1.0], device="vdev").tolist(),
                torch.tril_indices(2, 2, device="vdev").tolist(),
                str(torch.zeros(1).vdev().device), torch.zeros(1, device="vdev").is_vdev,
                str(torch.empty_like(torch.ones(2, device="vdev")).device),
                str(torch.ones(1, device="vdev").new_zeros(2).device)]

    @check
    def ops_views_inplace():
        x = torch.arange(6.0, device="vdev")
        v = x.view(2, 3)[:, 1]                           # a view of a view
        v.mul_(10)                                       # in place through the view
        x[0] = -1                                        # index_put through __setitem__
        o = torch.empty(0, device="vdev")
        torch.add(x, 1, out=o)                           # out= op resizes its output
        r = torch.empty(2, device="vdev"); r.resize_(3, 4)
        t = torch.randn(3, 4, device="vdev"); t.t_()
        s = x.add_(1)
        cat = torch.cat([x, x]); st = torch.stack([x, x])
        parts = x.chunk(3)
        return [x.tolist(), v._base is not None, o.shape[0], list(r.shape), list(cpu_data(r).shape),
                list(t.shape), list(t.stride()), s is x, cat.shape[0], list(st.shape), len(parts),
                x.sum().item(), float(x.max()), x[1].item(), str(x.sum().device),
                str(torch.where(x > 2, x, 0.0).device), x.nonzero().shape[0],
                x.view(2, 3).untyped_storage()._cdata == x.untyped_storage()._cdata]

    @check
    def transfers_copy_and_are_independent():
        c = torch.ones(3); v = c.to("vdev"); back = v.cpu()
        c.add_(1); back.add_(5)
        w = torch.empty(3, device="vdev"); w.copy_(torch.full((3,), 2.0))
        dst = torch.zeros(3); dst.copy_(w)
        return [v.tolist(), back.tolist(), dst.tolist(), str(back.device), str(v.to(torch.float64).dtype)]

    @check
    def device_mixing_raises():
        try:
            torch.ones(3, device="vdev") + torch.ones(3)
        except RuntimeError as e:
            msg = str(e)
        ok_scalar = (torch.ones(3, device="vdev") + torch.tensor(1.0)).tolist()
        ok_index = torch.arange(4.0, device="vdev")[torch.tensor([0, 2])].tolist()
        return [msg, ok_scalar, ok_index]

    @check
    def printing():
        return [repr(torch.arange(6, device="vdev").view(2, 3)),
                repr(torch.ones(2, device="vdev", requires_grad=True) * 2),
                repr(torch.nn.Linear(2, 2).to("vdev").bias).splitlines()[0],
                f"{torch.tensor(2.5, device='vdev'):.1f}"]

    @check
    def numpy_needs_cpu_first():
        try:
            torch.ones(2, device="vdev").numpy()
        except TypeError as e:
            return str(e)

    @check
    def complex_conj_bits():
        a = torch.randn(4, dtype=torch.complex128); b = torch.randn(4, dtype=torch.complex128)
        av, bv = a.to("vdev"), b.to("vdev")
        return [same(av * bv.conj(), a * b.conj()), same(torch._neg_view(bv) * av, -b * a),
                same(bv.conj().imag * 1, b.conj().imag)]

    @check
    def autograd_basics():
        x = torch.randn(4, 4, device="vdev", requires_grad=True)
        y = x * 1; y[:, 1].mul_(3)                       # in place on a view, then backward
        y.sum().backward()
        w = torch.ones(3, device="vdev", requires_grad=True)
        for _ in range(3):
            (w * 2).sum().backward()                   # gradient accumulation
        class Sq(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                ctx.save_for_backward(t); return t * t
            @staticmethod
            def backward(ctx, g):
                t, = ctx.saved_tensors; return 2 * t * g
        z = torch.randn(5, device="vdev", requires_grad=True)
        Sq.apply(z).sum().backward()
        u = torch.randn(5, device="vdev", requires_grad=True)
        gu, = torch.autograd.grad(torch.nn.functional.silu(u).sum(), u, create_graph=True)
        gu.sum().backward()                            # double backward
        return [x.grad[:, 1].tolist(), str(x.grad.device), w.grad.tolist(),
                same(z.grad, 2 * cpu_data(z).detach()), str(u.grad.device)]

    @check
    def backward_formulas_match_cpu():
        out = []
        for fn in (torch.nn.functional.silu, torch.nn.functional.mish, torch.nn.functional.gelu,
                   torch.tanh, lambda t: torch.softmax(t, -1), lambda t: torch.nn.functional.layer_norm(t, (8,))):
            a = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
            b = a.detach().to("vdev").requires_grad_()
            (fn(a) * torch.arange(32.0).view(4, 8)).sum().backward()
            (fn(b) * torch.arange(32.0).view(4, 8).to("vdev")).sum().backward()
            out.append(same(b.grad, a.grad))
        return out

    @check
    def module_to_and_param_data():
        m = torch.nn.Linear(3, 2)
        w0 = m.weight.detach().clone()
        m.to("vdev")
        p = m.weight
        p.data = torch.zeros(4, device="vdev", dtype=torch.float64)
        p.data.add_(1)
        m2 = torch.nn.Linear(3, 2).to("vdev").to(torch.bfloat16)
        import copy
        m3 = torch.nn.Linear(3, 2).to("vdev"); m4 = copy.deepcopy(m3)
        return [isinstance(m.bias, torch.nn.Parameter), str(m.bias.device), list(p.shape), str(p.dtype),
                p.tolist(), str(m2.weight.dtype), same(m4.weight, m3.weight.detach().cpu()),
                m4.weight.data_ptr() != m3.weight.data_ptr(), w0.shape == (2, 3)]

    @check
    def autocast_follows_cuda_policy():
        m = torch.nn.Linear(4, 4).to("vdev")
        x = torch.randn(2, 4, device="vdev")
        with torch.autocast("vdev", dtype=torch.bfloat16):
            y = m(x); s = torch.softmax(y, -1); n = torch.randn(2, device="vdev")
        return [str(y.dtype), str(s.dtype), str(n.dtype)]

    @check
    def save_load():
        import io
        buf = io.BytesIO()
        t = torch.randn(3, device="vdev")
        torch.save({"v": t, "c": torch.ones(2)}, buf)
        buf.seek(0); on_vdev = torch.load(buf, weights_only=True)
        buf.seek(0); on_cpu = torch.load(buf, weights_only=True, map_location="cpu")
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True, map_location="vdev")
            refused = None
        except RuntimeError as e:
            refused = str(e)
        return [str(on_vdev["v"].device), same(on_vdev["v"], t.cpu()), str(on_cpu["v"].device), refused]

    @check
    def distributed_default_backend():
        import torch.distributed as dist
        return dist.get_default_backend_for_device("vdev")
    """)


def test_the_parent_process_stays_a_cpu_process():
    assert "trex_vdev" not in sys.modules
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


def test_device_appears_through_torch_accelerator():
    r = core_results()
    assert ok(r, "accelerator") == [True, "vdev", 1, 0, "vdev"]
    assert ok(r, "register_is_idempotent") is True


def test_device_module():
    assert ok(core_results(), "device_module") == [True, True, 1, 0, "trex virtual device (CPU memory)",
                                                    True, True, True]


def test_memory_accounting_counts_live_storages_once():
    with_x, peak, after, via_accelerator = ok(core_results(), "memory_accounting")
    assert with_x == 4000 and peak == 5000 and after == 0 and via_accelerator == 0


def test_rng_is_the_cpu_generator():
    seeded, restored, gen_device, is_generator, gen_same, dropout_same = ok(core_results(), "rng_is_the_cpu_generator")
    assert seeded and restored and gen_same and dropout_same
    assert gen_device == "vdev:0" and is_generator


def test_a_seed_gives_the_same_weights_on_a_device_whose_generator_is_not_the_cpus():
    """Issue 53: an H200 run started from other weights than its CPU reference, because
    initialisation drew from the device's own generator (CUDA's Philox stream is not the CPU's).
    vdev's generator is a CPU generator by design, which hid it; without it (no device generator at
    all, as for a device whose stream differs) the tiny V4 (hash-routed MoE included) and V3 must
    still start from the CPU's weights."""
    r = run_child("""
    from trex.models.build import build_model
    from trex.models.registry import get_preset
    @check
    def same_weights():
        out = {}
        for name in ("tiny", "tiny-v3"):
            a, b = build_model(get_preset(name), seed=0), build_model(get_preset(name), device="vdev", seed=0)
            out[name] = [k for (k, p), q in zip(a.state_dict().items(), b.state_dict().values()) if not same(q, p)]
        return out
    """, env={"TREX_VDEV_PATCH_GENERATOR": "0"}, timeout=120)
    assert ok(r, "same_weights") == {"tiny": [], "tiny-v3": []}


def test_factories():
    r = ok(core_results(), "factories")
    assert r == ["VDevTensor", "vdev:0", [1.0, 1.0], [3.5, 3.5], [0, 1, 2, 3, 4], [[1.0, 0.0], [0.0, 1.0]],
                 [1, 2], [1.0], [[0, 1, 1], [0, 0, 1]], "vdev:0", True, "vdev:0", "vdev:0"]


def test_ops_views_and_inplace():
    r = ok(core_results(), "ops_views_inplace")
    x, has_base, out_len, r_shape, r_inner, t_shape, t_stride, same_obj, cat_len, st_shape, nparts, *rest = r
    assert x == [0.0, 11.0, 3.0, 4.0, 41.0, 6.0]  # -1+1, 1*10+1, 2+1, 3+1, 4*10+1, 5+1
    assert has_base and out_len == 6 and r_shape == r_inner == [3, 4]
    assert t_shape == [4, 3] and t_stride == [1, 4] and same_obj
    assert cat_len == 12 and st_shape == [2, 6] and nparts == 3
    total, mx, item, sum_dev, where_dev, nnz, view_shares_storage = rest
    assert total == 65.0 and mx == 41.0 and item == 11.0 and sum_dev == where_dev == "vdev:0"
    assert nnz == 5 and view_shares_storage


def test_transfers_copy():
    assert ok(core_results(), "transfers_copy_and_are_independent") == [
        [1.0, 1.0, 1.0], [6.0, 6.0, 6.0], [2.0, 2.0, 2.0], "cpu", "torch.float64"]


def test_device_mixing_raises_like_a_real_accelerator():
    msg, scalar, index = ok(core_results(), "device_mixing_raises")
    assert "Expected all tensors to be on the same device" in msg and "vdev:0 and cpu" in msg
    assert scalar == [2.0, 2.0, 2.0] and index == [0.0, 2.0]


def test_printing():
    grid, grad, param_head, fmt = ok(core_results(), "printing")
    assert grid == "tensor([[0, 1, 2],\n        [3, 4, 5]], device='vdev:0')"
    assert grad == "tensor([2., 2.], device='vdev:0', grad_fn=<MulBackward0>)"
    assert param_head == "Parameter containing:" and fmt == "2.5"
    assert "Use Tensor.cpu()" in ok(core_results(), "numpy_needs_cpu_first")


def test_complex_conj_and_neg_bits():
    assert ok(core_results(), "complex_conj_bits") == [True, True, True]


def test_autograd():
    col, dev, acc, custom, double = ok(core_results(), "autograd_basics")
    assert col == [3.0] * 4 and dev == "vdev:0" and acc == [6.0] * 3 and custom and double == "vdev:0"


def test_backward_formulas_are_bitwise_the_cpu_ones():
    assert ok(core_results(), "backward_formulas_match_cpu") == [True] * 6


def test_module_to_param_data_and_deepcopy():
    assert ok(core_results(), "module_to_and_param_data") == [
        True, "vdev:0", [4], "torch.float64", [1.0] * 4, "torch.bfloat16", True, True, True]


def test_autocast():
    assert ok(core_results(), "autocast_follows_cuda_policy") == ["torch.bfloat16", "torch.float32", "torch.float32"]


def test_torch_save_and_load():
    dev, data_same, cpu_dev, refused = ok(core_results(), "save_load")
    assert dev == "vdev:0" and data_same and cpu_dev == "cpu"
    assert refused and "map_location='cpu'" in refused


def test_distributed_default_backend_is_gloo():
    assert ok(core_results(), "distributed_default_backend") == "gloo"


# ---- training parity, checkpointing, state_dict -------------------------------------------------------
@functools.lru_cache(maxsize=None)
def training_results() -> dict:
    return run_child("""
    from torch import nn
    import io

    def train(device, foreach, fused=False, steps=5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Dropout(0.1),
                              nn.Linear(16, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach,
                                fused=fused or None)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 8, generator=g).to(device)
            y = torch.randint(0, 4, (32,), generator=g).to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}, model, opt

    def parity(foreach, fused=False):
        lc, wc, _, _ = train("cpu", foreach, fused)
        lv, wv, model, opt = train("vdev", foreach, fused)
        p = model[0].weight
        return [lc == lv, all(torch.equal(wc[k], wv[k]) for k in wc), lv,
                str(p.device), type(p).__name__, isinstance(p, nn.Parameter),
                str(opt.state[p]["exp_avg"].device)]

    @check
    def adamw_per_tensor():
        return parity(False)

    @check
    def adamw_foreach():
        return parity(True)

    @check
    def adamw_fused():
        return parity(False, fused=True)

    @check
    def activation_checkpoint():
        import torch.utils.checkpoint as cp
        def run(device, use_ckpt, reentrant=False):
            torch.manual_seed(0)
            lin = nn.Linear(8, 8).to(device)
            x = torch.randn(4, 8, device=device, requires_grad=True)
            def block(t):
                return nn.functional.dropout(torch.tanh(lin(t)), 0.5, training=True)
            out = cp.checkpoint(block, x, use_reentrant=reentrant) if use_ckpt else block(x)
            out.sum().backward()
            return [out.detach().cpu(), x.grad.cpu(), lin.weight.grad.cpu()]
        ck, plain, cpu_ck = run("vdev", True), run("vdev", False), run("cpu", True)
        re = run("vdev", True, reentrant=True)
        return [all(torch.equal(a, b) for a, b in zip(ck, plain)),
                all(torch.equal(a, b) for a, b in zip(ck, cpu_ck)),
                all(torch.equal(a, b) for a, b in zip(re, plain))]

    @check
    def state_dict_round_trip():
        def make():
            return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to("vdev")
        m = make(); m(torch.randn(3, 4, device="vdev"))          # running stats change
        sd = m.state_dict()
        direct = make(); direct.load_state_dict(sd)
        buf = io.BytesIO(); torch.save({k: v.cpu() for k, v in sd.items()}, buf); buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        via_file = make(); via_file.load_state_dict(loaded)
        from safetensors.torch import save, load
        st = load(save({k: v.detach().cpu().contiguous() for k, v in sd.items()}))
        via_st = make(); via_st.load_state_dict(st)
        ref = {k: v.cpu() for k, v in sd.items()}
        def equal(model):
            return all(torch.equal(v.cpu(), ref[k]) for k, v in model.state_dict().items())
        return [equal(direct), equal(via_file), equal(via_st),
                sorted({str(v.device) for v in via_file.state_dict().values()})]
    """)


def test_tiny_mlp_adamw_per_tensor_is_bitwise_cpu():
    same_losses, same_weights, losses, dev, cls, is_param, state_dev = ok(training_results(), "adamw_per_tensor")
    assert same_losses and same_weights, losses
    assert (dev, cls, is_param, state_dev) == ("vdev:0", "VDevTensor", True, "vdev:0")


def test_tiny_mlp_adamw_foreach_is_bitwise_cpu():
    same_losses, same_weights, *_ = ok(training_results(), "adamw_foreach")
    assert same_losses and same_weights


def test_tiny_mlp_adamw_fused_is_bitwise_cpu():
    same_losses, same_weights, *_ = ok(training_results(), "adamw_fused")
    assert same_losses and same_weights


def test_activation_checkpointing():
    ckpt_equals_plain, vdev_equals_cpu, reentrant_equals_plain = ok(training_results(), "activation_checkpoint")
    assert ckpt_equals_plain and vdev_equals_cpu and reentrant_equals_plain


def test_state_dict_round_trip():
    assert ok(training_results(), "state_dict_round_trip") == [True, True, True, ["vdev:0"]]


# ---- torch.compile -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torch_compile_sees_through_the_wrapper():
    r = run_child("""
    from torch import nn
    def f(x, y):
        return torch.sin(x) * y + 1

    @check
    def function():
        x = torch.randn(8, device="vdev"); y = torch.randn(8, device="vdev")
        out = {}
        for backend in ("eager", "aot_eager", "inductor"):
            torch._dynamo.reset()
            r = torch.compile(f, backend=backend, fullgraph=True)(x, y)
            torch._dynamo.reset()
            ref = torch.compile(f, backend=backend, fullgraph=True)(x.cpu(), y.cpu())  # same codegen on CPU
            out[backend] = [type(r).__name__, str(r.device), same(r, ref)]
        return out

    @check
    def training_step():
        def run(device):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)
            cm = torch.compile(m)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
            losses = []
            for i in range(2):
                x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i)).to(device)
                loss = cm(x).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
                losses.append(loss.item())
            return losses
        return [run("vdev"), run("cpu")]
    """, timeout=600)
    assert ok(r, "function") == {b: ["VDevTensor", "vdev:0", True] for b in ("eager", "aot_eager", "inductor")}
    vdev_losses, cpu_losses = ok(r, "training_step")
    assert vdev_losses == cpu_losses


# ---- torch.distributed through gloo ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_collectives_and_ddp_on_vdev_tensors_run_on_gloo():
    port = _free_port()
    body = """
    import os, datetime
    import torch.distributed as dist
    from torch import nn
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))

    @check
    def collectives():
        t = torch.full((3,), float(rank + 1), device="vdev"); dist.all_reduce(t)
        b = torch.full((2,), float(rank), device="vdev"); dist.broadcast(b, 0)
        g = torch.empty(4, device="vdev")
        dist.all_gather_into_tensor(g, torch.full((2,), float(rank), device="vdev"))
        rs = torch.empty(2, device="vdev"); dist.reduce_scatter_tensor(rs, torch.arange(4.0, device="vdev"))
        a = torch.ones(2, device="vdev"); dist.all_reduce(a, async_op=True).wait()
        return [t.tolist(), b.tolist(), g.tolist(), rs.tolist(), a.tolist(), str(t.device)]

    @check
    def ddp():
        def run(device):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
            ddp = nn.parallel.DistributedDataParallel(m)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for i in range(2):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + i)).to(device)
                loss = ddp(x).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
            return m[0].weight.detach().cpu()
        return torch.equal(run("vdev"), run("cpu"))

    dist.destroy_process_group()
    """
    from trex_run import python  # each rank a child forked from a warm process, as run_child's

    code = PRELUDE + textwrap.dedent(body) + EPILOGUE
    env = {"PYTHONPATH": str(ROOT / "src"), "PORT": str(port)}
    with ThreadPoolExecutor(max_workers=2) as pool:  # both ranks at once: they meet in init_process_group
        procs = list(pool.map(lambda r: python(code, env={**env, "RANK": str(r)}, cwd=str(ROOT)), range(2)))
    results = []
    for p in procs:
        marker = [line for line in p.stdout.splitlines() if line.startswith("@@RESULTS@@")]
        assert p.returncode == 0 and marker, f"rank failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        results.append(json.loads(marker[-1][len("@@RESULTS@@"):]))
    for rank, r in enumerate(results):
        assert ok(r, "collectives") == [[3.0] * 3, [0.0, 0.0], [0.0, 0.0, 1.0, 1.0],
                                        [0.0, 2.0] if rank == 0 else [4.0, 6.0], [2.0, 2.0], "vdev:0"]
        assert ok(r, "ddp") is True


# ---- trex on vdev -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_trex_tiny_model_trains_bitwise_like_cpu():
    r = run_child("""
    from trex import device
    from trex.models import build_model, get_preset

    @check
    def detect():
        dev = device.detect("vdev")
        return [dev.name, dev.count(), dev.backend(), dev.is_accelerator, dev.total_memory() > 0,
                sorted(dev.get_rng_state())]

    @check
    def parity():
        def run(dev):
            cfg = get_preset("tiny")
            model = build_model(cfg, device=torch.device(dev), dtype=torch.float32, seed=0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(dev)
            losses = []
            for _ in range(2):
                out = model(ids, labels=ids)
                loss = out.loss + 0.1 * out.mtp_loss
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}
        lv, sv = run("vdev"); lc, sc = run("cpu")
        return [lv == lc, [k for k in sc if not torch.equal(sv[k], sc[k])], lv]
    """, timeout=600)
    assert ok(r, "detect") == ["vdev:0", 1, "gloo", True, True, ["cpu", "vdev"]]
    same_losses, mismatching, losses = ok(r, "parity")
    assert same_losses and mismatching == [], (losses, mismatching)


# ---- what FSDP2/DTensor need: fake tensors, streams, storage resize, vdev:1 -----------------------------
def test_pieces_fsdp2_and_dtensor_rely_on():
    r = run_child("""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    @check
    def fake_tensors_of_device_vdev():
        with FakeTensorMode():                      # what DTensor's sharding propagation does
            x = torch.empty_strided((3, 4), (4, 1), device="vdev:1")
            y = x.t().contiguous()                  # a view: its meta tensor carries PrivateUse1
            z = (x @ y).sum(0)
        return [type(y).__name__, str(y.device), list(y.stride()), list(z.shape)]

    @check
    def streams_and_events():
        m = torch.vdev
        s = m.Stream(priority=-1)
        e = s.record_event()
        cur = m.current_stream()
        cur.wait_stream(s); cur.wait_event(e); e.synchronize()
        f = m.Event(); f.record(); f.wait(s)
        with m.stream(s):
            pass
        return [isinstance(s, torch.Stream), isinstance(e, torch.Event), e.query(), f.query()]

    @check
    def storage_resize_keeps_the_memory():
        t = torch.arange(6.0, device="vdev"); v = t.view(2, 3)
        st = t.untyped_storage()
        st.resize_(0); st.resize_(24)               # FSDP2's free_storage / alloc_storage: no-ops
        v.copy_(torch.ones(2, 3))
        try:
            st.resize_(48)
        except NotImplementedError as e:
            grow = str(e)
        plain = torch.ones(2).untyped_storage(); plain.resize_(4)   # other devices: torch's resize_
        return [st.size(), t.tolist(), str(st.device), "cannot grow" in grow, plain.size()]

    @check
    def second_device_index():
        x = torch.ones(3, device="vdev:1", requires_grad=True)
        (x * 2).sum().backward()                    # no autograd worker queue for vdev:1
        return [str(x.grad.device), x.grad.tolist(), str(x.new_tensor(1.0).device),
                str(x.new_tensor([1, 2], device="vdev:0").device)]

    @check
    def other_subclasses_go_first():
        seen = []
        class Other(torch.Tensor):                  # like DTensor in torch.where(mask, dtensor, 0)
            @staticmethod
            def __new__(cls, elem):
                return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
            def __init__(self, elem):
                self.elem = elem
            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                unwrap = lambda a: a.elem if isinstance(a, Other) else a
                seen.append(str(func))
                return func(*[unwrap(a) for a in args], **(kwargs or {}))
        out = torch.where(torch.tensor(True, device="vdev"), Other(torch.ones(2, device="vdev")), 0)
        return [seen, type(out).__name__, out.tolist()]
    """, env={"TREX_VDEV_COUNT": "2"})
    assert ok(r, "fake_tensors_of_device_vdev") == ["FakeTensor", "vdev:1", [3, 1], [3]]
    assert ok(r, "streams_and_events") == [True, True, True, True]
    assert ok(r, "storage_resize_keeps_the_memory") == [24, [1.0] * 6, "vdev:0", True, 4]
    assert ok(r, "second_device_index") == ["vdev:1", [2.0] * 3, "vdev:1", "vdev:0"]
    assert ok(r, "other_subclasses_go_first") == [["aten.where.self"], "VDevTensor", [1.0, 1.0]]


# ---- trex FSDP2 on two vdev processes -------------------------------------------------------------------
@pytest.mark.slow
def test_trex_fsdp2_two_processes_on_vdev_equal_the_cpu_run(tmp_path):
    """``torchrun --nproc-per-node=2`` with ``parallel.dp_shard=2``: each rank on vdev:<LOCAL_RANK>
    (TREX_VDEV_COUNT=2), FSDP2 over gloo, DTensor parameters, Muon. Exercises what FSDP2 needs from a
    device (streams/events, ``untyped_storage().resize_``, FakeTensor sharding propagation, backward
    on vdev:1, ``new_tensor``, DTensor mixed with vdev tensors). ``precision.dtype`` is pinned: by
    default trex computes in bf16 on an accelerator and in fp32 on CPU. The CPU run's ranks are forked from
    a warm process (tests/trex_run.py); the plugin's are processes of their own, as users start them."""
    from arithmetic_data import write_sft
    from trex_run import trex

    data = write_sft(tmp_path, n_train=200, n_eval=10)[0]
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("#\n")
    sets = [f'data.paths=["{data}"]', 'data.tokenizer="compact"', "data.seq_len=64", "data.micro_batch_size=1",
            "train.steps=3", "optim.lr=3e-3", "train.progress=false", "model.overrides={sliding_window=16}",
            "parallel.dp_shard=2", "train.grad_accum=2", 'optim.ns_dtype="fp32"', 'precision.dtype="fp32"']
    rows = {}
    for name, extra in (("cpu", {"TREX_DEVICE": "cpu"}),
                        ("vdev", {"TREX_DEVICE": "vdev", "TREX_DEVICE_PLUGINS": "trex_vdev", "TREX_VDEV_COUNT": "2"})):
        out = tmp_path / name
        args = ["train", str(recipe), "--out", str(out), *[a for s in sets for a in ("--set", s)]]
        proc = trex(args, procs=2, env={"PYTHONPATH": str(ROOT / "src"), **extra}, timeout=300)
        assert proc.returncode == 0, f"{name} (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        rows[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        if name == "vdev":
            summary = json.loads((out / "summary.json").read_text())
            assert summary["device"]["device_type"] == "vdev" and summary["steps_completed"] == 3
    assert [r["step"] for r in rows["vdev"]] == [r["step"] for r in rows["cpu"]] == [1, 2, 3]
    for c, v in zip(rows["cpu"], rows["vdev"]):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert abs(c[key] - v[key]) <= 1e-6 * abs(c[key]), (key, c["step"], c[key], v[key])
