"""Experiment trackers: TensorBoard, Weights & Biases, MLflow.

`build_trackers` turns `logging.backends` into tracker objects for rank 0's `MetricsLogger`
(which writes the stdout line and ``metrics.jsonl`` itself). Every tracker gets the same
namespaced metric names (``loss/total``, ``reward/mean``, ...) at the same step, and the run's
resolved config once. A resumed run continues the same tracker run:

- ``tensorboard``: event files in ``RUN/tensorboard``; steps after the resume point are purged.
- ``wandb``: project ``$WANDB_PROJECT`` or ``vlrl``, files under ``RUN/wandb``. Without
  ``WANDB_API_KEY`` (and no ``WANDB_MODE`` set) it runs offline; ``wandb sync RUN/wandb/offline-*``
  uploads later. The run id is kept in ``RUN/trackers.json`` and resumed with ``resume="allow"``.
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a SQLite store ``RUN/mlflow/mlflow.db`` with
  artifacts in ``RUN/mlflow/artifacts`` (MLflow's file-system store is deprecated and refused by
  MLflow >= 3.x unless opted in). Experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``vlrl``; the run id
  is kept in ``RUN/trackers.json``; the config goes in as parameters and ``config.yaml``.

wandb and mlflow are optional: ``pip install -e '.[wandb]'`` / ``'.[mlflow]'``. Naming one that
is not installed fails at start with that command; a tracker that fails mid-run is warned about
once and dropped, so a tracking outage never stops training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Protocol, Sequence

log = logging.getLogger("vlrl")

BACKENDS = ("tensorboard", "jsonl", "wandb", "mlflow")
_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
_IDS_FILE = "trackers.json"


class Tracker(Protocol):
    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_backends(backends: Sequence[str]) -> list[str]:
    """The backends, validated: known names, no repeats. Raises ValueError naming the key."""
    names = list(backends)
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"config key 'logging.backends': unknown backend {name!r}; "
                             f"choose from {', '.join(BACKENDS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"config key 'logging.backends' names a backend twice: {names}")
    return names


def _load_ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / _IDS_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _save_id(run_dir: Path, backend: str, run_id: str) -> None:
    ids = _load_ids(run_dir)
    ids[backend] = run_id
    draft = run_dir / (_IDS_FILE + ".tmp")
    draft.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(draft, run_dir / _IDS_FILE)


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} → {'a.b': 1}."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _missing(backend: str) -> RuntimeError:
    return RuntimeError(f"config key 'logging.backends' names {backend!r} but the {backend} package "
                        f"is not installed: pip install -e '.[{_EXTRAS[backend]}]', or drop it from "
                        f"logging.backends")


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        if config and start_step == 0:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, start_step: int, config: dict | None):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        offline = not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE")
        run_id = _load_ids(run_dir).get(self.name) or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "vlrl"), name=run_dir.name, id=run_id,
            resume="allow", dir=str(run_dir), config=config or {},
            mode="offline" if offline else None,
        )
        _save_id(run_dir, self.name, run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, start_step: int, config: dict | None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow") from None

        store = run_dir / "mlflow"
        store.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = _load_ids(run_dir).get(self.name) or self._create_run(run_dir, store, config)
        _save_id(run_dir, self.name, self.run_id)

    def _create_run(self, run_dir: Path, store: Path, config: dict | None) -> str:
        from mlflow.entities import Param

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "vlrl")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (store / "artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        if config:
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[start : start + 100])
            self.client.log_dict(run_id, config, "config.yaml")
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for start in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=rows[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def build_trackers(backends: Sequence[str], run_dir: str | Path, *, start_step: int = 0,
                   config: dict | None = None) -> list[Tracker]:
    """One tracker per backend other than ``jsonl`` (MetricsLogger writes that file itself)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return [_TRACKERS[name](run_dir, start_step, config) for name in check_backends(backends)
            if name != "jsonl"]


class TrackerSet:
    """The trackers of one run: logs to each, and drops one that fails (warned once)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, metrics)
            except Exception as error:  # a tracking outage must not stop training
                log.warning("tracker %s failed at step %d (%s: %s); it is dropped for the rest of the run",
                            tracker.name, step, type(error).__name__, error)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as error:
                log.warning("tracker %s failed to close (%s: %s)", tracker.name, type(error).__name__, error)
        self.trackers = []
