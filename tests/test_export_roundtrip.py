"""Every export trex writes loads back with `load_pretrained` and gives the run's logits: for each family (V4,
V4.1, the V3 family: V3, V3.2, Moonlight), each layout it is exported in and each precision, a training
checkpoint of a model built as a run on the preset with the compact tokenizer builds it (`model_for`), its
routers' biases moved as training moves them, is exported with `export_checkpoint` and loaded back.

Unquantised exports give the run's model exactly (fp32), or the run's model cast to bf16 (bf16); quantised ones
give the run's weights quantised and dequantised as the codec the writer names for each tensor (FP8 block
scales, FP4 experts), every other tensor exact. The checkpoint keeps the tokenizer the run trained with, as the
loop's checkpointer does (a real run's export: tests/test_drafter_refit.py, tiny-v4.1 from its preset)."""

from __future__ import annotations

import pytest
import torch

from trex import device
from trex.checkpoint import load_pretrained
from trex.checkpoint.export import export_checkpoint
from trex.checkpoint.layouts import codec_for
from trex.checkpoint.training import RunState, save_checkpoint
from trex.data.tokenizer import compact_tokenizer
from trex.kernels import quantize as quant
from trex.precision import PrecisionPolicy
from trex.recipe import load, to_dict
from trex.train.config import TrainRecipe
from trex.train.loop import model_for

# preset -> the layouts it is exported in and the quantisations of its released checkpoints
FAMILIES = {
    "tiny": (("hf", "official"), ("fp8", "fp8+fp4experts")),
    "tiny-v4.1": (("official",), ("fp8", "fp8+fp4experts")),
    "tiny-v3": (("hf",), ("fp8",)),
    "tiny-v3.2": (("hf",), ("fp8",)),
    "tiny-moonlight": (("hf",), ()),
}
CASES = [(preset, layout, "fp32", None) for preset, (layouts, _) in FAMILIES.items() for layout in layouts]
CASES += [(preset, layouts[0], "bf16", None) for preset, (layouts, _) in FAMILIES.items()]
CASES += [(preset, layouts[0], "fp32", q) for preset, (layouts, qs) in FAMILIES.items() for q in qs]
# codec -> FP8 block and scale format (DeepSeek-V4's ue8m0, V4.1's 32x32 and per-row tables, V3's fp32)
FP8 = {"fp8": ((128, 128), "ue8m0"), "fp8/32": ((32, 32), "ue8m0"), "fp8/1x32": ((1, 32), "ue8m0"),
       "fp8/fp32": ((128, 128), "fp32")}


class _Nothing:
    """A step guard, schedule and data position with nothing to save."""

    def state_dict(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """preset -> (the run's model, its training checkpoint step_1, token ids, the model's logits on them), made
    once per preset."""
    made = {}

    def run(preset: str):
        if preset not in made:
            out = tmp_path_factory.mktemp(preset.replace(".", ""))
            recipe = load(TrainRecipe, overrides=[f'model.preset="{preset}"', 'data.tokenizer="compact"',
                                                  f'train.out="{out}"'])
            tokenizer, dev = compact_tokenizer(), device.detect("cpu")
            model = model_for(recipe, tokenizer, dev, PrecisionPolicy.resolve("fp32", dev))
            with torch.no_grad():  # as training moves them (init leaves them 0)
                for name, b in model.named_buffers():
                    if name.endswith("gate.bias"):
                        b.copy_(0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(len(name))))
            state = RunState(model, torch.optim.SGD(model.parameters(), lr=0.0), _Nothing(), _Nothing(), _Nothing(),
                             dev)
            save_checkpoint(str(out / "checkpoints"), 1, state, config=to_dict(recipe),
                            tokenizer=tokenizer.backend.to_str())
            ids = torch.randint(0, model.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = model.eval()(ids).logits
            made[preset] = model, str(out / "checkpoints" / "step_1"), ids, logits
        return made[preset]
    return run


def _expected(model, dtype: torch.dtype, quantize: str | None) -> dict[str, torch.Tensor]:
    """The run's model's state as the export should load back: each quantised tensor through its codec
    (quantised, then dequantised), then cast to ``dtype``."""
    state = {}
    for key, t in model.state_dict().items():
        codec = codec_for(key, quantize, model.cfg.architecture)
        if codec in FP8:
            block, fmt = FP8[codec]
            t = quant.dequantize_fp8(*quant.quantize_fp8(t, block, fmt))
        elif codec == "fp4":
            t = quant.dequantize_fp4(*quant.quantize_fp4(t), cols=t.shape[-1])
        state[key] = t.to(dtype) if t.is_floating_point() else t
    return state


@pytest.mark.parametrize("preset,layout,dtype,quantize", CASES, ids=lambda v: str(v))
def test_an_export_loads_back_to_the_runs_logits(runs, tmp_path, preset, layout, dtype, quantize):
    model, step, ids, logits = runs(preset)
    out = tmp_path / "export"
    export_checkpoint(step, str(out), layout=layout, dtype=dtype, quantize=quantize)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    loaded = load_pretrained(str(out), dtype=torch_dtype, device="cpu").eval()
    expected, got = _expected(model, torch_dtype, quantize), loaded.state_dict()
    assert set(got) == set(expected)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, differ[:5]
    with torch.no_grad():
        served = loaded(ids).logits.float()
    if quantize is None and dtype == "fp32":
        assert torch.equal(served, logits)
    else:  # exact above in the weights; the logits within the cast's or quantisation's error (V3.2's indexer
        # may pick other keys: 0.11 measured for FP8, the others 0.006-0.06)
        assert ((served - logits).norm() / logits.norm()).item() < 0.2


def test_a_v41_checkpoint_without_its_tokenizer_is_refused_before_anything_is_written(runs, tmp_path, capsys):
    """A checkpoint of an older trex (no tokenizer.json) of a V4.1 run on a preset: export says in one line why
    the export would not load, exits 2 and writes nothing."""
    from trex.cli import main

    model, _, _, _ = runs("tiny-v4.1")
    dev = device.detect("cpu")
    state = RunState(model, torch.optim.SGD(model.parameters(), lr=0.0), _Nothing(), _Nothing(), _Nothing(), dev)
    save_checkpoint(str(tmp_path / "checkpoints"), 1, state)
    step = str(tmp_path / "checkpoints" / "step_1")
    capsys.readouterr()
    assert main(["ckpt", "export", step, str(tmp_path / "out"), "--layout", "official"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"trex ckpt export: {step}: no tokenizer.json"), err
    assert "Engram" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset,layout,quantize,reason", [
    ("tiny-v4.1", "hf", None, "DeepSeek-V4.1 is written in the official layout"),
    ("tiny-v3", "official", None, "DeepSeek-V3 family checkpoints are written in the hf layout"),
    ("tiny-v3", "hf", "fp8+fp4experts", "the DeepSeek-V3 family is released as FP8"),
])
def test_a_layout_or_precision_a_family_is_not_written_in_is_refused_before_anything_is_written(
        runs, tmp_path, capsys, preset, layout, quantize, reason):
    """What save_pretrained and convert refuse, export refuses too, in one line, exit 2, writing nothing (a V4.1
    export in the hf layout was written, in names nothing but trex reads)."""
    from trex.cli import main

    _, step, _, _ = runs(preset)
    capsys.readouterr()
    assert main(["ckpt", "export", step, str(tmp_path / "out"), "--layout", layout,
                 *(["--quantize", quantize] if quantize else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"trex ckpt export: {reason}"), err
    assert not (tmp_path / "out").exists()
