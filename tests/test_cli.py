"""The command line's own contract: user faults end in one clean line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trex import device
from trex.cli import main


def test_a_device_this_machine_lacks_is_one_line_and_exit_2(capsys):
    missing = next(t for t in ("npu", "xpu", "mps") if t not in device.available_types())
    assert main(["--device", missing, "env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"trex: device '{missing}' was requested")


def test_a_reader_that_leaves_early_is_not_an_error_trace():
    proc = subprocess.Popen([sys.executable, "-m", "trex", "fidelity", "profiles"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has already exited: every write gets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["audit", "/no/such/path"]])
def test_one_prefix_per_message(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trex audit: '/no/such/path'") and err.count("trex audit:") == 1


@pytest.mark.parametrize("argv", [["--help"], ["audit", "src/trex/fidelity", "--format", "json"], ["fidelity", "profiles"],
                                  ["ckpt", "convert", "--help"], ["report", "--help"]])
def test_commands_that_compute_nothing_on_a_device_start_without_torch(argv):
    """Registering the commands imports no torch (1-2 s of every start): help, the audit and the fidelity
    profiles answer at once (`trex plan` still imports it: the planner reads the model's and kernels' sizes). The check runs in a fresh interpreter, where nothing has imported torch yet."""
    code = ("import sys\nfrom trex.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "False", proc.stderr[-2000:]


def test_a_lazy_export_may_not_share_a_submodules_name():
    from trex.lazy import lazy_exports

    with pytest.raises(ValueError, match="model_facts"):
        lazy_exports("trex.plan", {"model_facts": "model_facts"})
    assert lazy_exports("trex.plan", {"Layout": "layout"})("Layout").__name__ == "Layout"


@pytest.mark.parametrize("preset,typo,meant", [("tiny-v3", "n_grop", "n_group"),
                                               ("tiny", "sliding_windw", "sliding_window"),
                                               ("tiny-v4.1", "engram_n_head", "engram_n_heads")])
def test_a_model_override_the_config_lacks_gets_did_you_mean_in_one_line(tmp_path, capsys, preset, typo, meant):
    """model.overrides names fields of the preset's config (V4's, V4.1's, the V3 family's): a typo is named, with
    the closest field, by what set it (a --set, dotted or a table, or the recipe file), exit 2, no traceback."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[model]\npreset = "{preset}"\noverrides = {{ {typo} = 4 }}\n')
    said = f"unknown key `model.overrides.{typo}`; did you mean `model.overrides.{meant}`?\n"
    table = f"model.overrides={{{typo}=4}}"
    for sets, where in (([], str(recipe)), (["--set", table], f"--set {table}"),
                        (["--set", "model.overrides={}", "--set", f"model.overrides.{typo}=4"],
                         f"--set model.overrides.{typo}=4")):
        assert main(["train", str(recipe), *sets, "--out", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err == f"trex train: {where}: {said}"
    assert not (tmp_path / "run").exists()
