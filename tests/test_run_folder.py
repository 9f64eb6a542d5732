"""The run folder: one owner (a kernel lock, whatever PID namespace the other trainer runs in), `overwrite`
deleting only what vlrl wrote and starting new tracker runs, and the start-up errors about the folder."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from grpo.checkpoint import CheckpointError
from grpo.config import load_config
from grpo.metrics import MetricsLogger, _truncate_after
from grpo.run_folder import (
    LOCK_NAME, RunFolderError, RunLock, check_resume, check_resume_data, check_resume_model, claim_run_folder,
    overwrite_run, write_config,
)
from grpo.trackers import TensorBoardTracker, check_trackers
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
FORK = multiprocessing.get_context("fork")  # children that need no fresh interpreter (importing torch is slow)


def _hold(run: Path, content: str, queue) -> None:
    lock = RunLock.acquire(run)
    if content:
        lock.path.write_text(content)
    queue.put("held")
    time.sleep(120)


def start_holder(run: Path, content: str = ""):
    """A forked process that holds the run folder's lock and then writes `content` into the lock file."""
    queue = FORK.Queue()
    proc = FORK.Process(target=_hold, args=(run, content, queue), daemon=True)
    proc.start()
    assert queue.get(timeout=60) == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_run(run: Path) -> None:
    """An earlier run's files as vlrl writes them (a TensorBoard event file recorded by its writer)."""
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "__0_0.distcp").write_bytes(b"weights")
    (run / "checkpoints" / "step_2.tmp").mkdir()
    (run / "checkpoints" / "latest").write_text("step_1\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/total": 1.0}) + "\n")
    TensorBoardTracker(run, 0, None).close()
    (run / "config.yaml").write_text("earlier: run\n")


def claim(run: Path, *overrides: str):
    return claim_run_folder(load_config(None, [f"trainer.run_dir={run}", *overrides]), run, is_main=True)


# --- invariant 1: one owner per run folder ----------------------------------------------------
def test_a_held_lock_is_refused_whatever_pid_its_file_names(tmp_path):
    """The holder's PID as another PID namespace or container sees it may not exist here; it is never
    judged dead: the kernel lock decides, and overwrite deletes nothing of the live run."""
    run = tmp_path / "run"
    make_run(run)
    gone = dead_pid()
    for content in (json.dumps({"pid": gone, "host": os.uname().nodename, "started": "earlier"}), "not a lock {"):
        holder = start_holder(run, content)
        try:
            with pytest.raises(RunFolderError) as info:
                claim(run, "checkpoint.resume=overwrite")
            message = str(info.value)
            assert f"trainer.run_dir={run} is in use by" in message and "\n" not in message
            assert (f"PID {gone} on host" in message) if "pid" in content else "another process" in message
            assert (run / "metrics.jsonl").is_file() and (run / "checkpoints" / "step_1" / "__0_0.distcp").is_file()
            assert (run / LOCK_NAME).read_text() == content  # the holder's file, untouched
        finally:
            holder.kill()
            holder.join()
    lock = RunLock.acquire(run)  # the holder is gone: the kernel released its lock
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_NAME).exists()


HOLDER = """
import sys, time
from pathlib import Path
from grpo.run_folder import RunLock
RunLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_a_trainer_in_another_pid_namespace_is_refused(tmp_path):
    """A holder in its own PID namespace (as in another container) whose PID, and that PID's start time,
    mean something else here."""
    run = tmp_path / "run"
    prefix = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid --mount-proc is not permitted here")
    holder = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        assert line.strip() == "held", holder.stderr.read()[-2000:]
        seen = json.loads((run / LOCK_NAME).read_text())
        assert seen["pid"] != holder.pid  # its PID inside its namespace
        with pytest.raises(RunFolderError, match=f"in use by PID {seen['pid']} on host"):
            RunLock.acquire(run)
    finally:
        holder.kill()
        holder.wait()


def _contend(run: Path, start: float, rounds: int, queue) -> None:
    for r in range(rounds):
        while time.time() < start + r * 0.5:
            time.sleep(0.001)
        try:
            lock = RunLock.acquire(run)
        except RunFolderError:
            continue
        t0 = time.monotonic()
        time.sleep(0.2)
        queue.put((r, t0, time.monotonic()))
        if r % 2:  # end as kill -9 would: the kernel drops the lock, the file stays for the next round
            os.close(lock.fd)
            lock.fd = None
        else:
            lock.release()


def test_contenders_get_exactly_one_owner_at_a_time(tmp_path):
    """Four processes contend in each of eight rounds, over a lock file that is absent or left by a dead
    holder; owners' holding intervals never overlap, and every round has an owner."""
    run = tmp_path / "run"
    run.mkdir()
    rounds, start, queue = 8, time.time() + 1.0, FORK.Queue()
    procs = [FORK.Process(target=_contend, args=(run, start, rounds, queue), daemon=True) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    held = []
    while not queue.empty():
        held.append(queue.get(timeout=5))
    held.sort(key=lambda h: h[1])
    assert {h[0] for h in held} == set(range(rounds)), held
    assert all(a[2] <= b[1] for a, b in zip(held, held[1:])), f"two owners at once: {held}"


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory", "fifo"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_in_one_line(tmp_path, kind):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.write_text("someone else's file\n")
    path = run / LOCK_NAME
    if kind == "symlink":
        path.symlink_to(elsewhere)
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "nothing")
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(RunFolderError) as info:
        claim(run)
    message = str(info.value)
    what = {"symlink": "a symbolic link", "dangling symlink": "a symbolic link", "directory": "a directory",
            "fifo": "not a regular file"}[kind]
    assert message.startswith(f"{path} is {what}") and "Remove it" in message and "\n" not in message
    assert elsewhere.read_text() == "someone else's file\n" and not (tmp_path / "nothing").exists()


def test_a_garbage_lock_nobody_holds_is_taken_with_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_bytes(b"\xff\x00 not json")
    with caplog.at_level("WARNING", logger="vlrl"):
        lock = RunLock.acquire(run)
    assert "taking over the lock left by an unreadable holder" in caplog.text
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert RunLock.acquire(run) is lock  # a second Trainer in this process shares it
    lock.release()
    assert (run / LOCK_NAME).exists()  # still held by the first user
    lock.release()
    assert not (run / LOCK_NAME).exists()


def test_a_filesystem_without_locks_is_named(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(RunFolderError, match="does not support file locks.*put trainer.run_dir on a filesystem"):
        RunLock.acquire(tmp_path / "run")


# --- invariant 2: overwrite deletes only what vlrl wrote ---------------------------------------
def test_overwrite_refuses_foreign_files_and_then_deletes_exactly_vlrl_s(tmp_path, caplog):
    run = tmp_path / "run"
    make_run(run)
    (run / "notes.txt").write_text("mine\n")
    (run / "wandb").mkdir()
    (run / "wandb" / "offline-run-1").mkdir()
    recorded = sorted(p.name for p in (run / "tensorboard").iterdir())
    (run / "tensorboard" / "curves.png").write_bytes(b"png")  # tools/plot_metrics.py's default output
    foreign = {"checkpoints/my_model.pt": b"user weights", "checkpoints/export.tmp": b"user temp",
               "tensorboard/other_tool.tfevents": b"x",
               "tensorboard/events.out.tfevents.1.otherhost.7.0": b"another writer's events"}
    for name, data in foreign.items():
        (run / name).write_bytes(data)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(RunFolderError) as info:
        check_resume("overwrite", run)
    message = str(info.value)
    assert all(name in message for name in foreign) and "nothing was deleted" in message and "\n" not in message
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    for name in foreign:
        (run / name).unlink()
    with caplog.at_level("WARNING", logger="vlrl"):
        check_resume("overwrite", run)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert left == ["config.yaml", "notes.txt", "wandb", "wandb/offline-run-1"]
    assert f"tensorboard/{recorded[0]}" in caplog.text and "checkpoints/step_1" in caplog.text


def test_overwrite_never_deletes_through_a_symlink(tmp_path):
    run, disk = tmp_path / "run", tmp_path / "other_disk"
    make_run(run)
    shutil.move(run / "checkpoints", disk)
    (run / "checkpoints").symlink_to(disk)
    with pytest.raises(RunFolderError, match=r"checkpoints \(a symbolic link to .*other_disk\).*nothing was deleted"):
        check_resume("overwrite", run)
    assert (disk / "step_1" / "__0_0.distcp").is_file() and (run / "metrics.jsonl").is_file()
    (run / "checkpoints").unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step_1").symlink_to(disk / "step_1")
    (run / "metrics.jsonl.bad").symlink_to(tmp_path / "theirs.log")
    with pytest.raises(RunFolderError) as info:
        check_resume("overwrite", run)
    assert "checkpoints/step_1 (a symbolic link" in str(info.value) and "metrics.jsonl.bad (a symbolic link" in str(
        info.value)
    assert (disk / "step_1" / "__0_0.distcp").is_file() and (run / "checkpoints" / "step_1").is_symlink()


def test_overwrite_that_fails_midway_reports_only_what_went(tmp_path, monkeypatch):
    run = tmp_path / "run"
    make_run(run)

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(RunFolderError) as info:
        overwrite_run(run)
    message = str(info.value)
    assert f"deleting {run / 'checkpoints' / 'step_1'} failed (Permission denied)" in message
    assert "deleted so far: metrics.jsonl, trackers.json, checkpoints/latest." in message
    assert (run / "checkpoints" / "step_1").is_dir()


# --- invariant 3: trackers follow the run ------------------------------------------------------
def test_overwrite_starts_new_tracker_runs(tmp_path, monkeypatch):
    started = []

    class Run:
        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        started.append(kwargs["id"])
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"

    def start(step):
        logger = MetricsLogger(run, enabled=True, total_steps=3, start_step=step, stdout=False, progress=False,
                               backends=["jsonl", "wandb", "tensorboard"], config={})
        logger.log(step + 1, {"loss/total": 1.0})
        logger.close()

    start(0)
    start(1)  # a resume continues the same run
    assert started[0] == started[1] == json.loads((run / "trackers.json").read_text())["wandb"]
    assert len(list((run / "tensorboard").iterdir())) == 2
    check_resume("overwrite", run)
    assert not (run / "trackers.json").exists() and not (run / "tensorboard").exists()
    start(0)
    assert started[2] != started[0] and json.loads((run / "trackers.json").read_text())["wandb"] == started[2]


# --- start-up errors, in one line --------------------------------------------------------------
def test_unknown_and_missing_backends_fail_in_claim(tmp_path, monkeypatch):
    with pytest.raises(RunFolderError, match=r"logging.backends': unknown backend 'tensorbord'"):
        claim(tmp_path / "a", "logging.backends=[jsonl,tensorbord]")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RunFolderError, match=r"names 'wandb' but the wandb package is not installed: pip install"):
        claim(tmp_path / "b", "logging.backends=[jsonl,wandb]")
    assert not (tmp_path / "b" / LOCK_NAME).exists() and not (tmp_path / "b" / "config.yaml").exists()
    assert check_trackers(["jsonl", "tensorboard"], tensorboard=False) == ["jsonl"]


def test_a_resume_typo_gets_the_values(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    with pytest.raises(RunFolderError) as info:
        claim(run, "checkpoint.resume=overwite")
    message = str(info.value)
    assert "'overwite' (did you mean overwrite?): it must be one of auto, never, overwrite" in message
    assert "can write" not in message and (run / "metrics.jsonl").is_file()
    (run / "checkpoints" / "step_3").mkdir()
    with pytest.raises(RunFolderError, match="step_3: not a complete checkpoint folder"):
        check_resume(str(run / "checkpoints" / "step_3"), run)


def test_config_yaml_is_written_by_write_config_only(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    cfg = load_config(None, [f"trainer.run_dir={run}", "checkpoint.resume=never"])
    with pytest.raises(RunFolderError, match="already holds a run"):
        claim_run_folder(cfg, run, is_main=True)
    assert (run / "config.yaml").read_text() == "earlier: run\n" and not (run / LOCK_NAME).exists()
    fresh = tmp_path / "fresh"
    lock = claim(fresh)
    assert (fresh / LOCK_NAME).is_file() and not (fresh / "config.yaml").exists()
    write_config(cfg, fresh, is_main=True)
    assert "run_dir" in (fresh / "config.yaml").read_text() and not list(fresh.glob("*.tmp"))
    lock.release()


def test_a_changed_model_or_dataset_is_named(tmp_path):
    ckpt, model = tmp_path / "step_3", tmp_path / "model"
    ckpt.mkdir()
    model.mkdir()
    config = {"model_type": "qwen2_5_vl", "text_config": {"hidden_size": 64, "dtype": "float32"},
              "transformers_version": "5.0", "_name_or_path": "a"}
    (ckpt / "config.json").write_text(json.dumps(config))
    (model / "config.json").write_text(json.dumps({**config, "transformers_version": "5.9", "_name_or_path": "b",
                                                   "text_config": {"hidden_size": 64, "dtype": "bfloat16"}}))
    check_resume_model(ckpt, str(model))  # the same model, saved by another version: fine
    (model / "config.json").write_text(json.dumps({**config, "text_config": {"hidden_size": 128}}))
    with pytest.raises(CheckpointError) as info:
        check_resume_model(ckpt, str(model))
    assert str(info.value).startswith(f"model.path={model} is not the model checkpoint {ckpt} was trained from "
                                      "(text_config.hidden_size is 64 there, 128 here)")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3, "data": {"stream": {"size": 48}}}))
    check_resume_data(ckpt, 48, "train.parquet")
    with pytest.raises(CheckpointError, match="data.train_path=other.parquet has 40 rows, but checkpoint .* of 48 rows"):
        check_resume_data(ckpt, 40, "other.parquet")


def test_metrics_rows_without_an_integer_step_do_not_block_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss/total": 0.5}) for s in (1, 2, 3)]
    odd = ['{"step": Infinity}', '{"step": NaN}', '{"step": -Infinity, "loss/total": 1}', '{"step": "2"}',
           '{"step": true}', '{"step": 1e400}', "[" * 100000]
    path.write_text("\n".join([good[0], *odd, good[1], good[2]]) + "\n")
    with caplog.at_level("WARNING", logger="vlrl"):
        _truncate_after(path, 2)
    assert path.read_text() == good[0] + "\n" + good[1] + "\n"
    assert f"{path}: {len(odd)} unreadable line(s) (line 2, 3, 4, 5, 6, 7, 8:" in caplog.text
    assert (tmp_path / "metrics.jsonl.bad").read_text().splitlines() == odd


def test_scratch_run_dir_is_per_launch_and_removed_at_exit(tmp_path):
    code = ("from grpo.run_folder import scratch_run_dir; p = scratch_run_dir('probe'); "
            "p.mkdir(parents=True); (p / 'x').write_text('1'); print(p)")
    env = {**os.environ, "MASTER_PORT": "54321", "RANK": "0", "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    path = Path(out.stdout.strip())
    assert path.name == "vlrl_probe_54321" and path.parent == tmp_path
    assert not path.exists()  # rank 0 removed it when the process ended
