"""How trex's library messages reach the user.

Policy: modules log through ``logging.getLogger(__name__)`` (all under "trex"); they never print,
except the CLI's own results and the progress bar. :func:`to_terminal` (called by the CLI) sends
INFO and above to stderr as ``trex: message`` and ``trex: warning: message``; under torchrun, ranks
other than 0 show warnings and errors only, as ``trex[rank 3]: ...``. ``TREX_LOG_LEVEL`` (DEBUG,
INFO, WARNING, ERROR) changes the level. A run also writes every message, with a timestamp, to its
run directory's ``train.log`` (:func:`to_file`), and lists its warnings in its summary.json
(:class:`Recorded`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER = logging.getLogger("trex")
_TERMINAL = "_trex_terminal"


class _Format(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"{self.prefix}: {level}{record.getMessage()}"


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a redirected or captured stderr included)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def to_terminal() -> None:
    """Show trex's messages on stderr (idempotent)."""
    if any(getattr(h, _TERMINAL, False) for h in LOGGER.handlers):
        return
    rank = int(os.environ.get("RANK", "0"))
    handler = _Stderr()
    setattr(handler, _TERMINAL, True)
    handler.setFormatter(_Format("trex" if rank == 0 else f"trex[rank {rank}]"))
    level = os.environ.get("TREX_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"TREX_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING or ERROR")
    handler.setLevel(level if rank == 0 else max(logging.WARNING, logging.getLevelName(level)))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(min(LOGGER.getEffectiveLevel(), logging.getLevelName(level)))


def to_file(path: str) -> logging.Handler:
    """Also write every trex message (DEBUG up) to ``path``; returns the handler, for ``remove``."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.DEBUG)  # the terminal handler keeps its own level
    return handler


class Recorded(logging.Handler):
    """The warnings of a block (``with Recorded() as recorded``): every trex message at WARNING or above and
    every Python warning shown (``"UserWarning: text (file:line)"``, still shown as before), each once, in
    order, in ``messages`` (at most ``limit``; then a last line counts the rest, all of them in train.log)."""

    def __init__(self, limit: int = 100):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.limit, self.more = limit, 0
        self._catch = None

    def emit(self, record: logging.LogRecord) -> None:
        self.add(record.getMessage())

    def add(self, message: str) -> None:
        line = " ".join(message.split())
        if line in self.messages:
            return
        if len(self.messages) < self.limit:
            self.messages.append(line)
        else:
            self.more += 1

    def lines(self) -> list[str]:
        """``messages``, and how many more there were."""
        return self.messages + ([f"{self.more} more warning(s): see train.log"] if self.more else [])

    def __enter__(self) -> "Recorded":
        LOGGER.addHandler(self)
        self._catch = warnings.catch_warnings()  # showwarning restored on exit
        self._catch.__enter__()
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            self.add(f"{category.__name__}: {message} ({filename}:{lineno})")
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)
        LOGGER.removeHandler(self)


def remove(handler: logging.Handler) -> None:
    LOGGER.removeHandler(handler)
    handler.close()


def os_error_line(e: OSError) -> str:
    """One line for an OSError: trex's own message, or "PATH: reason" for one from the system."""
    if e.filename is None:
        return str(e)
    target = f"{e.filename} -> {e.filename2}" if e.filename2 else str(e.filename)
    return f"{target}: {e.strerror or e}"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and its noun, for a message: singular for exactly one ("1 rank", "3 ranks", "1,200 steps");
    ``nouns`` is an irregular plural (``plural(n, "process", "processes")``)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
