"""The text form of a `trex profile` report (trex.profile.run): the step's line, the classes, the
device estimates."""

from __future__ import annotations


def _num(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g}{prefix}{unit}"
    return f"{x:.{digits}g}{unit}"


def format_report(r: dict) -> str:
    lines = _meta_lines(r) if r["device"] == "meta" else _measured_lines(r)
    if r.get("estimate_note"):
        lines += ["", r["estimate_note"]]
    if r.get("estimates"):
        lines += _estimate_lines(r)
    lines += ["", f"profile.json" + ("" if r["device"] == "meta" else " and trace.json (Chrome trace)")
              + f": {r['run_dir']}"]
    return "\n".join(lines)


def _meta_lines(r: dict) -> list[str]:
    lines = [f"meta device: one step of {r['recipe_model']}, {r['dtype']}, {r['tokens_per_step']:,} tokens; "
             f"its ops recorded, no time measured", "",
             f"{'class':<20} {'kernels':>8} {'FLOPs':>8} {'bytes':>8}"]
    for c in r["classes"]:
        lines.append(f"{c['class']:<20} {c['launches']:>8} {_num(c['flops']):>8} {_num(c['bytes'], 'B'):>8}")
    return lines


def _measured_lines(r: dict) -> list[str]:
    mfu = f"{r['mfu']:.2%}" if r.get("mfu") is not None else "- (no peak for this device)"
    lines = [
        f"device {r['device']}, {r['dtype']}, {'compiled' if r['compiled'] else 'eager'}; "
        f"{r['steps_profiled']} profiled step(s), timed by {r['timing']}",
        f"step {r['step_s'] * 1e3:.1f} ms, {r['tokens_per_step']:.0f} tokens, {r['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {mfu}, optimizer {r['optimizer_share']:.1%} of the step, peak memory "
        f"{r['peak_memory_bytes'] / 2**30:.2f} GiB",
        f"the classes add up to {r['classes_sum_s'] * 1e3:.1f} ms ({r['sum_vs_step']:.1%} of the step)",
        "",
        f"{'class':<20} {'ms':>9} {'share':>7} {'kernels':>8} {'FLOPs':>8} {'bytes':>8} {'FLOP/s':>8} {'B/s':>8}",
    ]
    for c in r["classes"]:
        lines.append(f"{c['class']:<20} {c['time_s'] * 1e3:>9.2f} {c['share']:>7.1%} {c['launches']:>8} "
                     f"{_num(c['flops']):>8} {_num(c['bytes'], 'B'):>8} {_num(c['tflops_per_s'] and c['tflops_per_s'] * 1e12):>8} "
                     f"{_num(c['gb_per_s'] and c['gb_per_s'] * 1e9, 'B'):>8}")
    return lines


def _estimate_lines(r: dict) -> list[str]:
    est = r["estimates"]
    as_dtype = est[0]["as_dtype"]
    lines = ["", "estimated on each hardware profile (roofline of the ops above, ms per step, compiled"
             + (f"; the model's fp32 work priced as {as_dtype}" if as_dtype else "") + "):", "",
             f"{'class':<20}" + "".join(f" {e['hardware'][:14]:>14}" for e in est)]
    for c in [c["class"] for c in r["classes"] if c["class"] in est[0]["classes"]]:
        lines.append(f"{c:<20}" + "".join(f" {e['classes'][c]['compiled_s'] * 1e3:>14.3f}" for e in est))
    lines.append(f"{'step, compiled':<20}" + "".join(f" {e['compiled_s'] * 1e3:>14.3f}" for e in est))
    lines.append(f"{'step, eager':<20}" + "".join(f" {e['eager_s'] * 1e3:>14.3f}" for e in est))
    for key, label in (("mfu_compiled", "MFU, compiled"), ("mfu_eager", "MFU, eager"),
                       ("mfu_compiled_forward_backward", "MFU fwd+bwd, comp."),
                       ("optimizer_share_compiled", "optimizer, compiled")):
        lines.append(f"{label:<20}" + "".join(
            f" {e[key]:>14.1%}" if e[key] is not None else f" {'-':>14}" for e in est))
    return lines
