"""Experiment trackers beside metrics.jsonl and TensorBoard: ``[logging]`` in the recipe (off by default).

Rank 0 sends every scalar it logs (the same keys and steps as TensorBoard), the flattened recipe, the
environment and the run directory as parameters, and at the end the run's health and ``summary.json``.
Each tracker's package is an optional extra, imported only when the tracker is on
(``pip install 'trex[wandb]'``, ``'trex[mlflow]'``, ``'trex[swanlab]'``); a missing package is one line naming
the extra.

- Resuming: ``trackers.json`` in the run directory keeps each tracker's run id and the last step it
  took; a resumed run continues that tracker run and skips the steps it already holds (the ones logged
  after the checkpoint, before the kill, which the resumed run trains again), so every step appears once.
- Failures: a tracker that raises (server down, disk full) is reported once, in the log, and the run
  goes on; the steps it missed are counted in ``summary.json`` (``trackers``). A tracker that cannot start
  stops the run before step 1, in one line naming it.
- A run that fails (an error after set-up, a dead rollout engine) ends each tracker's run as failed, with
  the status and reason as end tags and ``summary.json`` attached: W&B with exit code 1 (its offline files
  say so to ``wandb sync``), MLflow ``FAILED``, SwanLab ``crashed``. A W&B session that logged no step is
  removed (offline: its ``offline-run-*`` directory), so that ``wandb sync`` uploads no empty run.

Weights & Biases (``wandb_project``; ``wandb_mode = "offline"`` writes ``<run>/wandb/offline-run-*`` for
``wandb sync`` from an air-gapped cluster) and MLflow (``mlflow_tracking_uri``: a tracking server, the usual
choice on premises, or a ``sqlite:`` / ``file:`` store; a ``file:`` store, which MLflow keeps in maintenance
mode behind ``MLFLOW_ALLOW_FILE_STORE=true``, gets that setting unless the environment says otherwise) and
SwanLab (``swanlab_project``; ``swanlab_mode = "offline"`` writes ``<run>/swanlog/run-*`` for ``swanlab
sync``; its "local" mode is not offered: it needs ``swanlab[dashboard]``, whose rich pin conflicts with trex's).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

from trex import atomic
from trex.recipe import check_choices

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"


@dataclass
class LoggingSection:
    """Experiment trackers (trex.train.trackers); each is off until configured."""
    wandb_project: str = ""
    """Weights & Biases project (empty: W&B off). Needs ``pip install 'trex[wandb]'``."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: the account's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online, or offline (files under the run directory, for ``wandb sync`` where there is no internet)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server (http://host:5000) or store (sqlite:///..., file:...); empty: MLflow off. Needs
    ``pip install 'trex[mlflow]'``."""
    mlflow_experiment: str = "trex"
    """The MLflow experiment the run goes to (created when missing)."""
    swanlab_project: str = ""
    """SwanLab project (empty: SwanLab off). Needs ``pip install 'trex[swanlab]'``."""
    swanlab_mode: Literal["online", "offline"] = "online"
    """online, or offline (files under the run directory, for ``swanlab sync``)."""

    def __post_init__(self) -> None:
        check_choices(self, "logging")


def _require(package: str, setting: str):
    """``package`` imported, or ValueError naming the recipe key that turned its tracker on and the extra."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ValueError(f"logging.{setting} is set but the {package} package is missing: "
                         f"pip install 'trex[{package}]'") from None


class WandbTracker:
    name, setting = "wandb", "wandb_project"

    def __init__(self, section: LoggingSection, directory: str, run_id: str | None):
        wandb = _require("wandb", "wandb_project")
        self.run_id = run_id or secrets.token_hex(4)
        self.run = wandb.init(project=section.wandb_project, entity=section.wandb_entity or None,
                              mode=section.wandb_mode, id=self.run_id, resume="allow", dir=directory,
                              settings=wandb.Settings(console="off", silent=True))
        self.offline, self.sync_dir, self.steps = section.wandb_mode == "offline", self.run.sync_dir, 0

    def params(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)
        self.steps += 1

    def tags(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def artifact(self, path: str) -> None:
        self.run.save(path, base_path=os.path.dirname(path), policy="now")

    def close(self, failed: str = "") -> None:
        """Finish the run (exit code 1 if ``failed``); a failed session that logged no step is removed from the
        offline files, which ``wandb sync`` would upload as an empty run."""
        self.run.finish(exit_code=1 if failed else 0)
        if failed and self.offline and not self.steps and os.path.isdir(self.sync_dir):
            remove_session(self.sync_dir)
            log.info("W&B: the failed run logged no step: its offline files %s are removed (nothing for wandb sync)",
                     self.sync_dir)


def remove_session(sync_dir: str) -> None:
    """Remove a W&B session's directory (``wandb/offline-run-*``), the links to it beside it (``latest-run``,
    ``debug.log``) and ``wandb/`` itself once empty."""
    parent = os.path.dirname(sync_dir)
    shutil.rmtree(sync_dir, ignore_errors=True)
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if os.path.islink(path) and not os.path.exists(path):
            os.remove(path)
    if not os.listdir(parent):
        os.rmdir(parent)


class MLflowTracker:
    """A run of ``mlflow_experiment`` through MLflow's client; requests fail fast (no retries, a 10 s timeout,
    unless the environment sets MLFLOW_HTTP_REQUEST_*), so an outage costs steps, not the run's time."""

    name, setting = "mlflow", "mlflow_tracking_uri"
    _KEY = re.compile(r"[^\w\-. /]")  # the characters MLflow refuses in a metric or parameter name

    def __init__(self, section: LoggingSection, directory: str, run_id: str | None):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if urlparse(section.mlflow_tracking_uri).scheme in ("", "file"):  # MLflow's file store, in maintenance mode
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        _require("mlflow", "mlflow_tracking_uri")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
        self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
        self.client = MlflowClient(tracking_uri=section.mlflow_tracking_uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(section.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(section.mlflow_experiment))
            run_id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(directory))
                                            ).info.run_id
        self.run_id = run_id

    def _key(self, key: str) -> str:
        return self._KEY.sub("_", key)[:250]

    def params(self, values: dict[str, Any]) -> None:
        items = [self.Param(self._key(k), str(v)[:6000]) for k, v in values.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a request
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(self._key(k), v, now, step) for k, v in scalars.items()])

    def tags(self, values: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[self.RunTag(self._key(k), str(v)[:5000]) for k, v in values.items()])

    def artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def close(self, failed: str = "") -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class SwanlabTracker:
    name, setting = "swanlab", "swanlab_project"

    def __init__(self, section: LoggingSection, directory: str, run_id: str | None):
        self.swanlab = swanlab = _require("swanlab", "swanlab_project")
        self.run = swanlab.init(project=section.swanlab_project, mode=section.swanlab_mode,
                                log_dir=os.path.join(directory, "swanlog"), name=os.path.basename(
                                    os.path.abspath(directory)), id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id

    def params(self, values: dict[str, Any]) -> None:
        self.swanlab.config.update(values)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.swanlab.log(scalars, step=step)

    def tags(self, values: dict[str, Any]) -> None:
        self.swanlab.config.update({f"end.{k}": v for k, v in values.items()})

    def artifact(self, path: str) -> None:
        with open(path) as f:
            self.swanlab.log({os.path.basename(path): self.swanlab.Text(f.read())})

    def close(self, failed: str = "") -> None:
        if failed:
            self.swanlab.finish(state="crashed", error=failed)
        else:
            self.swanlab.finish()


class Trackers:
    """The configured trackers of a run (none when ``enabled`` is false: ranks other than 0)."""

    def __init__(self, section: LoggingSection, directory: str, enabled: bool):
        self.directory, self.state_path = directory, os.path.join(directory, STATE_FILE)
        self.kinds = [kind for kind, on in ((WandbTracker, section.wandb_project), (MLflowTracker,
                                            section.mlflow_tracking_uri), (SwanlabTracker, section.swanlab_project))
                      if enabled and on]
        self.section = section
        self.active: dict[str, Any] = {}
        self.state: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.missed: dict[str, list[int]] = {}

    def start(self, resumed: bool, params: dict[str, Any]) -> None:
        """Open (or, resumed, continue) each tracker's run; a fresh run records ``params``."""
        if not self.kinds:
            return
        if resumed and os.path.exists(self.state_path):
            with open(self.state_path) as f:
                self.state = json.load(f)
        for kind in self.kinds:
            entry = self.state.get(kind.name)
            try:
                tracker = kind(self.section, self.directory, None if entry is None else entry["id"])
            except ValueError:
                raise
            except Exception as e:  # a server that does not answer, a store MLflow refuses: before step 1
                raise ValueError(f"logging.{kind.setting} = {getattr(self.section, kind.setting)!r}: the {kind.name} "
                                 f"tracker did not start: {type(e).__name__}: {' '.join(str(e).split())[:1000]}"
                                 ) from None
            self.active[kind.name] = tracker
            if entry is None:  # a new tracker run records the parameters (a continued one has them)
                self.state[kind.name] = {"id": tracker.run_id, "last_step": -1}
                self._call(kind.name, -1, "params", params)
        self._save()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """The finite scalars of ``metrics`` at ``step``, to every tracker that does not hold the step yet."""
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for name in self.active:
            if step <= self.state[name]["last_step"]:
                continue  # logged before a kill, and trained again after the resume
            if self._call(name, step, "log", step, scalars):
                self.state[name]["last_step"] = step
        if self.active:
            self._save()

    def finish(self, tags: dict[str, Any], summary_path: str | None, failed: str = "") -> dict[str, dict]:
        """Record ``tags`` (the health statement, migrations), attach ``summary_path``, close (as failed, with
        ``failed`` the reason, when the run failed); returns what summary.json records per tracker: its run id,
        the last step it holds, and the steps it missed."""
        for name in list(self.active):
            self._call(name, -1, "tags", tags)
            if summary_path and os.path.exists(summary_path):
                self._call(name, -1, "artifact", summary_path)
            self._call(name, -1, "close", failed)
        self.active.clear()
        return {name: {"run_id": entry["id"], "last_step": entry["last_step"],
                       "missed_steps": self.missed.get(name, []),
                       **({"error": self.errors[name]} if name in self.errors else {})}
                for name, entry in self.state.items()}

    def _call(self, name: str, step: int, method: str, *args) -> bool:
        try:
            getattr(self.active[name], method)(*args)
            return True
        except Exception as e:  # a tracker never stops training: reported once, its gap counted
            if name not in self.errors:
                self.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.warning("%s tracker failed%s (%s); training goes on, summary.json lists the steps it missed",
                            name, f" at step {step}" if step >= 0 else "", self.errors[name])
            if step >= 0:
                self.missed.setdefault(name, []).append(step)
            return False

    def _save(self) -> None:
        atomic.write_json(self.state_path, self.state)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of "a.b.c" keys (a recipe as tracker parameters)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out
