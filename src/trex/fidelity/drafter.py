"""``trex fidelity drafter``: does a post-trained checkpoint still speculate like its source?

Post-training moves the backbone's hidden states away from the ones its drafter was trained on, so speculative
decoding may accept fewer drafted tokens: the serving cost of a post-trained model rises without any loss curve
showing it. Two drafters (``trex.models.registry.drafter_kind``): DeepSeek-V4.1's DSpark stages (``mtp.*``,
carried through training and export unchanged unless ``[drafter]`` re-fits them), and the multi-token
prediction modules of DeepSeek-V4 and the V3 family (``mtp.N``, one token drafted per module, as vLLM and
SGLang serve them). This loads each checkpoint with its drafter, greedy-decodes the same prompts and reports
the drafts' acceptance (``trex.rollout.speculation``), the checkpoint beside its ``--base``.

Prompts are a JSONL (or Parquet) file, one object per line: ``{"prompt": "text"}`` or ``{"messages": [...]}``,
rendered as every prompt option renders them (the chat format's generation prompt, ``--chat-format``) and
tokenised with the checkpoint's ``tokenizer.json``, or ``{"ids": [token ids]}`` as they are. Without drafting
steps (every continuation ended too soon to check a draft) the measure is "n/a" and says why
(``Acceptance.reason``).
"""

from __future__ import annotations

import json
import os

from trex.rollout.speculation import Acceptance


class DrafterCheckError(ValueError):
    """A user fault (a bad prompts file, a checkpoint without a drafter): one line, exit 2."""


def read_prompts(path: str, checkpoint: str, chat_format: str = "deepseek-v4", thinking: bool = False
                 ) -> list[list[int]]:
    """The prompts of JSONL / Parquet file ``path`` as token ids: ``{"ids": [...]}`` as they are; ``{"prompt":
    text}`` and ``{"messages": [...]}`` as every prompt option takes them (trex.posttrain.on_policy.record_prompt:
    ``chat_format``'s generation prompt, as a run's ``[drafter]`` renders its held-out prompts), tokenised with
    ``checkpoint``'s tokenizer."""
    from trex.data.records import BadRecordError, RecordError, iter_records
    from trex.posttrain.on_policy import record_prompt

    formats = '{"prompt": text}, {"messages": [...]} or {"ids": [token ids]} per line'
    if not os.path.isfile(path):
        raise DrafterCheckError(f"{path}: no such prompts file (JSONL: {formats})")
    prompts, tokenizer = [], None
    try:
        for rec in iter_records([path]):
            data = rec.data
            if isinstance(data, RecordError):
                raise BadRecordError(rec.path, rec.line, data.reason, data.detail)
            ids = data.get("ids")
            if isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids):
                prompts.append(ids)
            elif "ids" in data or not (data.get("prompt") or isinstance(data.get("messages"), list)):
                raise DrafterCheckError(f"{path}:{rec.line}: expected {{\"prompt\": non-empty text}}, {{\"messages\": "
                                        f"[...]}} or {{\"ids\": [token ids >= 0]}}, got {json.dumps(data)[:80]}")
            else:
                tokenizer = tokenizer or _tokenizer(checkpoint)
                prompts.append(record_prompt(rec, tokenizer, thinking, chat_format).ids)
    except BadRecordError as e:
        raise DrafterCheckError(str(e)) from None
    if not prompts:
        raise DrafterCheckError(f"{path}: no prompts")
    return prompts


def _tokenizer(checkpoint: str):
    """``checkpoint``'s tokenizer (tokenizer.json or tokenizer/tokenizer.json) as trex renders chat with it."""
    from trex.data import load_tokenizer

    for name in ("tokenizer.json", os.path.join("tokenizer", "tokenizer.json")):
        if os.path.exists(os.path.join(checkpoint, name)):
            try:
                return load_tokenizer(os.path.join(checkpoint, name))
            except ValueError as e:  # no chat special tokens: the prompts cannot be rendered
                raise DrafterCheckError(f"{e}; give the prompts as {{\"ids\": [token ids]}}") from None
    raise DrafterCheckError(f"{checkpoint}: no tokenizer.json to encode the text prompts with (give {{\"ids\": ...}})")


def check_checkpoint(path: str) -> None:
    """DrafterCheckError unless ``path`` is a directory with a config.json (a checkpoint), naming what it is."""
    expected = ("expected a checkpoint directory: config.json and safetensors with its drafter's mtp.* tensors "
                "(DeepSeek-V4.1's DSpark stages, or the MTP modules of DeepSeek-V4 and the V3 family)")
    if not os.path.isdir(path):
        raise DrafterCheckError(f"{path}: {'not a directory' if os.path.exists(path) else 'no such path'}; {expected}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        run = os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(os.path.join(path, "config.toml"))
        raise DrafterCheckError(f"{path}: no config.json; {expected}" + (
            " (a trex run directory: `trex ckpt export RUN/checkpoints/step_N OUT` writes its model as one)"
            if run else ""))


def measure(checkpoint: str, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
            device: str | None = None) -> Acceptance:
    """The acceptance of ``checkpoint``'s drafter (its DSpark stages or MTP modules) on its own greedy
    decoding of ``prompts``."""
    from trex.checkpoint import CheckpointError, load_pretrained
    from trex.checkpoint.load import load_drafter
    from trex.models.common.config import ConfigError
    from trex.rollout.speculation import measure_acceptance, measure_mtp_acceptance

    check_checkpoint(checkpoint)
    drafter = None
    try:
        if drafter_of(checkpoint) == "dspark":
            drafter = load_drafter(checkpoint, device=device)
            model = load_pretrained(checkpoint, dtype=next(drafter.parameters()).dtype, device=device)
        else:
            model = load_pretrained(checkpoint, device=device)
    except (CheckpointError, ConfigError) as e:
        raise DrafterCheckError(" ".join(line.strip() for line in str(e).splitlines())) from None
    vocab = model.cfg.vocab_size
    bad = next((i for i, p in enumerate(prompts) if max(p) >= vocab), None)
    if bad is not None:
        raise DrafterCheckError(f"prompt {bad + 1} has token id {max(prompts[bad])}; {checkpoint}'s vocabulary has {vocab}")
    stop = () if model.cfg.eos_token_id is None else (model.cfg.eos_token_id,)
    if drafter is None:
        return measure_mtp_acceptance(model, prompts, max_new_tokens, pad_id=0, stop_ids=stop, batch_size=batch_size)
    return measure_acceptance(model, drafter, prompts, max_new_tokens, pad_id=0, stop_ids=stop, batch_size=batch_size)


def drafter_of(checkpoint: str) -> str:
    """"dspark" or "mtp": the drafter ``checkpoint`` holds; DrafterCheckError when its config has none, or its
    MTP modules' tensors are not in it (the model would start them fresh: nothing to measure)."""
    from trex.checkpoint import CheckpointError
    from trex.checkpoint.reader import CheckpointReader
    from trex.models.build import build_model
    from trex.models.common.config import ConfigError
    from trex.models.registry import drafter_kind

    try:
        reader = CheckpointReader(checkpoint)
        kind = drafter_kind(reader.config)
        if kind is None:
            raise DrafterCheckError(f"{checkpoint}: its config has no drafter (DeepSeek-V4.1: num_nextn_predict_layers "
                                    "and dspark_target_layer_ids; DeepSeek-V4 / V3: num_nextn_predict_layers > 0)")
        if kind == "mtp":
            meta = build_model(reader.config, device="meta")
            fresh = reader.check({k: tuple(t.shape) for k, t in [*meta.named_parameters(), *meta.named_buffers()]})
            if fresh:
                raise DrafterCheckError(f"{checkpoint}: no MTP module weights ({len(fresh)} tensors missing, e.g. "
                                        f"{fresh[0]}): the config has {reader.config.num_nextn_predict_layers} "
                                        "module(s) but the checkpoint does not hold them")
    except (CheckpointError, ConfigError) as e:
        raise DrafterCheckError(" ".join(line.strip() for line in str(e).splitlines())) from None
    return kind


def table(results: dict[str, Acceptance]) -> str:
    """One line per checkpoint: steps measured, drafted tokens accepted per step, tokens per model step, and
    the share of steps that accepted each draft position."""
    block = next(iter(results.values())).block_size
    head = f"{'checkpoint':<40} {'steps':>6} {'accepted/step':>14} {'tokens/step':>12}  " + " ".join(
        f"{'pos' + str(i + 1):>6}" for i in range(block))
    lines = [head]
    for name, a in results.items():
        if a.steps:
            rates = " ".join(f"{r:>6.1%}" for r in a.rates())
            lines.append(f"{name:<40} {a.steps:>6} {a.mean_accepted:>14.3f} {a.tokens_per_step:>12.3f}  {rates}")
        else:
            lines.append(f"{name:<40} {a.steps:>6} {'n/a':>14} {'n/a':>12}  ({a.reason})")
    return "\n".join(lines)



def to_dict(a: Acceptance) -> dict:
    """One checkpoint's entry of ``--format json`` (Acceptance.to_dict, the mean named ``accepted_per_step``)."""
    return {"accepted_per_step" if k == "mean_accepted" else k: v for k, v in a.to_dict().items()}
