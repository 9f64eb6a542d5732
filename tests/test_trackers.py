"""Experiment trackers behind MetricsLogger: backends, names, config, resume, failures."""

import json
import logging
import sys
import time

import pytest
import yaml

from grpo.metrics import MetricsLogger
from grpo.trackers import TrackerSet, build_trackers, check_backends

METRICS = {"loss/total": 0.5, "reward/mean": 0.25, "perf/step_s": 1.5}
CONFIG = {"trainer": {"max_steps": 3}, "logging": {"backends": ["jsonl"], "tensorboard": True}}


def _run(run_dir, steps, *, start=0, **kwargs):
    logger = MetricsLogger(run_dir, enabled=True, total_steps=3, start_step=start, stdout=False,
                           progress=False, **kwargs)
    for step in steps:
        logger.log(step, {k: v * step for k, v in METRICS.items()})
    logger.close()


def _jsonl_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_backend_names_are_checked():
    assert check_backends(["jsonl", "wandb"]) == ["jsonl", "wandb"]
    with pytest.raises(ValueError, match=r"logging.backends.*'tensorbord'.*tensorboard"):
        check_backends(["tensorbord"])
    with pytest.raises(ValueError, match="twice"):
        check_backends(["jsonl", "jsonl"])


def test_default_writes_jsonl_and_tensorboard_with_the_same_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, [1, 2])
    assert _jsonl_steps(tmp_path) == [1, 2]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(METRICS)
    assert [e.step for e in events.Scalars("loss/total")] == [1, 2]


def test_tensorboard_false_and_saved_config_choose_backends(tmp_path):
    _run(tmp_path / "a", [1], tensorboard=False)
    assert (tmp_path / "a" / "metrics.jsonl").is_file() and not (tmp_path / "a" / "tensorboard").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(CONFIG))  # what the trainer saves
    _run(tmp_path / "b", [1])
    assert not (tmp_path / "b" / "tensorboard").exists()
    _run(tmp_path / "c", [1], backends=["tensorboard"])
    assert (tmp_path / "c" / "tensorboard").is_dir() and not (tmp_path / "c" / "metrics.jsonl").exists()


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False, total_steps=1, backends=["tensorboard", "jsonl"])
    logger.log(1, METRICS)
    logger.close()
    assert not (tmp_path / "run").exists()


def test_a_missing_package_fails_at_start_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for name in ("wandb", "mlflow"):
        with pytest.raises(RuntimeError, match=rf"pip install -e '\.\[{name}\]'"):
            build_trackers([name], tmp_path)


def test_a_failing_tracker_is_dropped_and_the_rest_go_on(caplog):
    class Broken:
        name = "broken"

        def log(self, step, metrics):
            raise ConnectionError("server gone")

        def close(self):
            pass

    class Kept:
        name = "kept"
        rows = []

        def log(self, step, metrics):
            self.rows.append(step)

        def close(self):
            pass

    trackers = TrackerSet([Broken(), Kept()])
    with caplog.at_level(logging.WARNING, logger="vlrl"):
        trackers.log(1, METRICS)
        trackers.log(2, METRICS)
    assert Kept.rows == [1, 2]
    assert sum("broken failed at step 1" in r.message for r in caplog.records) == 1


def test_wandb_offline_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install -e '.[wandb]'")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run(tmp_path, [1, 2], backends=["jsonl", "wandb"], config=CONFIG)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    _run(tmp_path, [3], start=2, backends=["jsonl", "wandb"], config=CONFIG)
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == run_id
    offline = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(path.name.endswith(run_id) for path in offline)
    # Offline runs keep their records in one binary log per start; the names are in it verbatim.
    # wandb's service may still be writing it for a moment after finish().
    wanted = [name.encode() for name in METRICS] + [b"max_steps"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = [(path / f"run-{run_id}.wandb").read_bytes() for path in offline]
        if all(name in log for name in wanted for log in logs):
            break
        time.sleep(0.5)
    assert all(name in log for name in wanted for log in logs)


def test_mlflow_local_store_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is an optional extra: pip install -e '.[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(tmp_path, [1, 2], backends=["jsonl", "mlflow"], config=CONFIG)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    _run(tmp_path, [3], start=2, backends=["jsonl", "mlflow"], config=CONFIG)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vlrl")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = client.get_metric_history(run_id, "loss/total")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 1.0), (3, 1.5)]
    run = client.get_run(run_id)
    assert set(run.data.metrics) == set(METRICS)
    assert run.data.params["trainer.max_steps"] == "3"
