"""Experiment trackers: TensorBoard, Weights & Biases, MLflow.

`build_trackers` turns `logging.backends` into tracker objects for rank 0's `MetricsLogger`
(which writes the stdout line and ``metrics.jsonl`` itself). Every tracker gets the same
namespaced metric names (``loss/total``, ``reward/mean``, ...) at the same step, and the run's
resolved config once. A resumed run continues the same tracker run; ``checkpoint.resume=overwrite``
deletes ``RUN/trackers.json`` (grpo/run_folder.py), so the new run gets new tracker runs:

- ``tensorboard``: event files in ``RUN/tensorboard``; steps after the resume point are purged. The
  name of each event file the writer creates is recorded in ``RUN/trackers.json``, so that
  ``overwrite`` deletes those files and no others.
- ``wandb``: project ``$WANDB_PROJECT`` or ``vlrl``, files under ``RUN/wandb``. Without
  ``WANDB_API_KEY`` (and no ``WANDB_MODE`` set) it runs offline; ``wandb sync RUN/wandb/offline-*``
  uploads later. The run id is kept in ``RUN/trackers.json`` and resumed with ``resume="allow"``.
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a SQLite store ``RUN/mlflow/mlflow.db`` with
  artifacts in ``RUN/mlflow/artifacts`` (MLflow's file-system store is deprecated and refused by
  MLflow >= 3.x unless opted in). Experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``vlrl``; the run id
  is kept in ``RUN/trackers.json``; the config goes in as parameters and ``config.yaml``.

wandb and mlflow are optional: ``pip install -e '.[wandb]'`` / ``'.[mlflow]'``. Naming one that
is not installed, or an unknown backend, fails at start in one line (``check_trackers``, before
any model is built); a tracker that fails mid-run is warned about once and dropped, so a
tracking outage never stops training. After ``overwrite`` the old wandb and MLflow runs stay in
their stores (``RUN/wandb``, ``RUN/mlflow``) as runs of their own.
"""

from __future__ import annotations

import importlib.util
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
IDS_FILE = "trackers.json"


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


def check_trackers(backends: Sequence[str], tensorboard: bool = True) -> list[str]:
    """`check_backends`, and each chosen tracker's package installed (found, not imported), so a
    missing one fails at start, before any model is built. `tensorboard=False` drops that backend."""
    names = [b for b in check_backends(backends) if tensorboard or b != "tensorboard"]
    found = {"tensorboard": lambda: importlib.util.find_spec("tensorboard"),
             "wandb": lambda: importlib.util.find_spec("wandb"),
             "mlflow": lambda: importlib.util.find_spec("mlflow")}
    for name in names:
        if name in found and found[name]() is None:
            raise _missing(name)
    return names


def _load_ids(run_dir: Path) -> dict:
    """trackers.json: the wandb and MLflow run ids of this run folder, and the TensorBoard event files
    vlrl's writer created in it (under "tensorboard_files"); {} when absent or unreadable."""
    path = run_dir / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _run_id(run_dir: Path, backend: str) -> str | None:
    run_id = _load_ids(run_dir).get(backend)
    return run_id if isinstance(run_id, str) and run_id else None


def tensorboard_files(run_dir: str | Path) -> list[str]:
    """The names of the event files in RUN/tensorboard that vlrl's writer created."""
    names = _load_ids(Path(run_dir)).get("tensorboard_files", [])
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _save_id(run_dir: Path, backend: str, run_id) -> None:
    ids = _load_ids(run_dir)
    ids[backend] = run_id
    draft = run_dir / (IDS_FILE + ".tmp")
    draft.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(draft, run_dir / IDS_FILE)


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
    install = f"pip install -e '.[{_EXTRAS[backend]}]'" if backend in _EXTRAS else f"pip install {backend}"
    return RuntimeError(f"config key 'logging.backends' names {backend!r} but the {backend} package "
                        f"is not installed: {install}, or drop it from logging.backends")


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter

        folder = run_dir / "tensorboard"
        before = set(os.listdir(folder)) if folder.is_dir() else set()
        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1)
        # the event file this writer created, recorded so checkpoint.resume=overwrite deletes exactly it
        created = sorted(set(os.listdir(folder)) - before)
        _save_id(run_dir, "tensorboard_files", sorted({*tensorboard_files(run_dir), *created}))
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
        run_id = _run_id(run_dir, self.name) or uuid.uuid4().hex[:12]
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
        self.run_id = _run_id(run_dir, self.name) or self._create_run(run_dir, store, config)
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
