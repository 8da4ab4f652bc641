"""A heartbeat that names the rank that stopped answering.

Without it, a frozen rank holds the whole job until the collective timeout (``parallel.timeout_s``),
and the error then names a rank that *waited*. With it, every rank runs one daemon thread that, every
``interval_s`` seconds,

- publishes its beat (a counter) and its place in the loop (step, phase) to the rendezvous store
  (the TCPStore at ``MASTER_ADDR:MASTER_PORT`` that torchrun hosts for the job), and
- reads every rank's beat and place, and judges them with `find_lost` on its own clock: a rank whose
  beat has not advanced for ``timeout_s`` has stopped answering (SIGSTOP, a dead host, a process
  wedged holding the interpreter); a rank that has stayed at its place for ``timeout_s`` after
  another moved past it is stuck outside the collectives (a hung read, a loop).

The watcher that finds one logs one line naming the rank, its step and phase and how long it has
been silent or stuck, calls ``on_lost`` (the loop records it in summary.json), and ends its process
with `EXIT_RANK_LOST`; the launcher then stops the rest. The thread never touches the device, so it
adds no synchronisation to the training step; the main thread's cost is one assignment per phase.

The backends' own flight recorders (NCCL, HCCL: a dump of the last collectives of each rank when a
collective times out) are switched on separately, through `trex.device.Device.flight_recorder_env`.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_RANK_LOST = 4
"""Exit code of a rank whose watcher found another rank lost."""

PHASES = ("setup", "step", "evaluate", "checkpoint", "summary", "done")
"""Where a rank can be, in loop order within one step. Only ranks in ``step``/``evaluate``/
``checkpoint`` can be judged stuck (setup and the summary legitimately run at different speeds on
different ranks); a ``done`` rank has left the loop and is not judged at all."""
_JUDGED = ("step", "evaluate", "checkpoint")
_GENERATIONS = itertools.count()  # heartbeats made by this process: the same sequence on every rank


@dataclass
class Seen:
    """What one watcher knows of one rank: its last beat and place, and when (on the watcher's
    monotonic clock, seconds) each last changed."""
    beat: int
    step: int
    phase: str
    beat_at: float
    place_at: float

    @property
    def place(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)


def find_lost(seen: dict[int, Seen], now: float, timeout_s: float) -> str | None:
    """The verdict on a job's ranks, or None when every rank is answering and moving.

    A rank is lost when its beat is ``timeout_s`` old, or when, still beating, it has stayed at its
    place for ``timeout_s`` after another rank moved past it (timed from the later of its own arrival
    and the first rank ahead reaching its place: a long first step with rank-0-only work at its end,
    such as opening TensorBoard, is not "stuck" the moment the other ranks move on). Silent ranks are
    reported before stuck ones (a silent rank also stops moving); among several, the lowest rank is named."""
    active = {r: s for r, s in seen.items() if s.phase != "done"}
    for rank, s in sorted(active.items()):
        if now - s.beat_at >= timeout_s:
            return (f"rank {rank} stopped answering: no heartbeat for {now - s.beat_at:.0f} s "
                    f"(last seen at step {s.step}, phase {s.phase})")
    ahead = max((s.place for s in active.values()), default=(0, 0))
    for rank, s in sorted(active.items()):
        fresh = now - s.beat_at < timeout_s / 2  # a rank going silent is judged silent, not stuck
        if not (fresh and s.phase in _JUDGED and s.place < ahead):
            continue
        behind_since = max(s.place_at, min(o.place_at for o in active.values() if o.place > s.place))
        if now - behind_since >= timeout_s:
            others = sorted(r for r, o in active.items() if o.place > s.place)
            return (f"rank {rank} is stuck: at step {s.step}, phase {s.phase} for {now - s.place_at:.0f} s while "
                    f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} moved on")
    return None


def _exit_lost(message: str) -> None:
    for handler in logging.getLogger("trex").handlers + logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)


class Heartbeat:
    """The heartbeat of one rank for one ``train()`` (see the module docstring): a context manager
    whose block calls `start` once the process group exists; leaving the block stops the thread.

    ``timeout_s`` 0 (or a single process, or no TCP rendezvous store) turns it off. Successive
    heartbeats of the same processes (the default job's CPT then SFT stage) keep separate records.
    ``on_lost(message)`` runs on the watcher thread before the process exits; ``exit`` (tests)
    replaces the exit."""

    def __init__(self, timeout_s: float, *, interval_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None, exit: Callable[[str], None] = _exit_lost):
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else max(0.2, min(5.0, timeout_s / 6))
        self.generation = next(_GENERATIONS)
        self.on_lost, self._exit = on_lost, exit
        self._place = (0, "setup")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.verdict: str | None = None

    @property
    def enabled(self) -> bool:
        return (self.timeout_s > 0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ)

    def at(self, step: int, phase: str) -> None:
        """Main thread: this rank is now at ``phase`` of step ``step`` (1-based; 0 before the first)."""
        self._place = (step, phase)

    @property
    def place(self) -> tuple[int, str]:
        """(step, phase) this rank last reported (`at`)."""
        return self._place

    def __enter__(self) -> Heartbeat:
        return self

    def start(self) -> None:
        """Begin beating and watching (a no-op when not `enabled`)."""
        if self.enabled and self._thread is None:
            rank, world = dist.get_rank(), dist.get_world_size()
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"trex/heartbeat/{restart}/{self.generation}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=max(self.timeout_s, 30)), wait_for_workers=False))
            self._publish(store, rank)
            self._thread = threading.Thread(target=self._run, args=(store, rank, world), daemon=True,
                                            name="trex-heartbeat")
            self._thread.start()

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._place = (self._place[0], "done")
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _publish(self, store: dist.Store, rank: int) -> None:
        step, phase = self._place
        store.set(f"place/{rank}", f"{step} {phase}")
        store.add(f"beat/{rank}", 1)

    def _run(self, store: dist.Store, rank: int, world: int) -> None:
        seen: dict[int, Seen] = {}
        started = time.monotonic()
        try:
            while True:
                stopping = self._stop.wait(self.interval_s)
                self._publish(store, rank)  # the last one says "done": the others stop judging this rank
                if stopping:
                    return
                now = time.monotonic()
                for r in range(world):
                    beat = store.add(f"beat/{r}", 0)  # 0 (and no wait) for a rank that has not published
                    step, phase = store.get(f"place/{r}").decode().split() if beat else (0, "setup")
                    old = seen.get(r) or Seen(beat, int(step), phase, started, started)
                    seen[r] = Seen(beat, int(step), phase, now if beat != old.beat else old.beat_at,
                                   now if (int(step), phase) != (old.step, old.phase) else old.place_at)
                verdict = find_lost(seen, now, self.timeout_s)
                if verdict is not None and not self._stop.is_set():
                    self._lost(f"rank {rank}: {verdict}; stopping the job (parallel.heartbeat_timeout_s = "
                               f"{self.timeout_s:g})")
                    return
        except Exception as e:  # the store itself went away: the launcher is tearing the job down
            if not self._stop.is_set():
                log.warning("heartbeat stopped: the rendezvous store does not answer (%s)", e)

    def _lost(self, message: str) -> None:
        self.verdict = message
        log.error("%s", message)
        if self.on_lost is not None:
            try:
                self.on_lost(message)
            except Exception as e:  # the exit below must happen regardless
                log.error("could not record the lost rank: %s", e)
        self._exit(message)
