"""No command loses or mixes a run's data: one owner per run folder, a start that never writes over an
earlier run unless told, torn metrics lines, image files sized before reading, workers that die with
their launcher. Unit tests run in this process; the end-to-end ones run the trainer under torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.images import BadSample, decode_image
from grpo.checkpoint import CheckpointError
from grpo.config import load_config
from grpo.metrics import _truncate_after
from grpo.run_folder import LOCK_NAME, RunFolderError, RunLock, check_resume, claim_run_folder
from tests.conftest import ROOT


def make_run(run: Path, rows: int = 3, steps=("step_1",)) -> None:
    """An earlier run's traces: metrics rows and (not necessarily complete) step folders."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss/total": 1.0}) + "\n"
                                               for i in range(rows)))
    for name in steps:
        (run / "checkpoints" / name).mkdir(parents=True)


# --- the lock (more in tests/test_run_folder.py) --------------------------------------------
def test_a_second_process_cannot_take_a_held_folder(tmp_path):
    run = tmp_path / "run"
    lock = RunLock.acquire(run)
    script = ("import sys; from pathlib import Path; from grpo.run_folder import RunLock, RunFolderError\n"
              "try:\n    RunLock.acquire(Path(sys.argv[1]))\nexcept RunFolderError as e:\n    print(e); sys.exit(5)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 5 and f"in use by PID {os.getpid()}" in proc.stdout, proc.stderr
    lock.release()


# --- checkpoint.resume against what the folder holds -------------------------------------------
def test_never_refuses_a_used_folder_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    make_run(run, rows=4, steps=("step_2", "step_4"))
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(RunFolderError) as info:
        check_resume("never", run)
    message = str(info.value)
    assert f"trainer.run_dir={run} already holds a run (metrics.jsonl with 4 rows; checkpoints step_2, step_4)" in message
    assert "checkpoint.resume=overwrite" in message and "checkpoint.resume=auto" in message
    assert (run / "metrics.jsonl").read_bytes() == before and (run / "checkpoints" / "step_4").is_dir()
    check_resume("never", tmp_path / "unused")  # nothing there: fine
    (tmp_path / "only_config").mkdir()
    (tmp_path / "only_config" / "config.yaml").write_text("a: 1\n")
    check_resume("never", tmp_path / "only_config")


def test_overwrite_starts_over(tmp_path, caplog):
    run = tmp_path / "run"
    make_run(run, rows=2, steps=("step_1", "step_2.tmp"))
    (run / "tensorboard").mkdir()
    (run / "config.yaml").write_text("old\n")
    with caplog.at_level("WARNING", logger="vlrl"):
        check_resume("overwrite", run)
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / "tensorboard").exists() and (run / "config.yaml").exists()
    assert "deleted the earlier run" in caplog.text and "metrics.jsonl with 2 rows" in caplog.text


def test_auto_refuses_metrics_without_any_checkpoint(tmp_path):
    run = tmp_path / "run"
    make_run(run, rows=3, steps=())
    with pytest.raises(RunFolderError, match="holds metrics.jsonl with 3 rows but no checkpoint.*resume=overwrite"):
        check_resume("auto", run)
    (run / "checkpoints" / "step_1.tmp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="step_1.tmp is an interrupted save"):
        check_resume("auto", run)
    check_resume("auto", tmp_path / "unused")


def test_claim_refuses_before_writing_config_and_releases_the_lock(tmp_path):
    run = tmp_path / "run"
    make_run(run, rows=1)
    (run / "config.yaml").write_text("the earlier run's config\n")
    cfg = load_config(None, [f"trainer.run_dir={run}", "checkpoint.resume=never"])
    with pytest.raises(RunFolderError, match="already holds a run"):
        claim_run_folder(cfg, run, is_main=True)
    assert (run / "config.yaml").read_text() == "the earlier run's config\n" and not (run / LOCK_NAME).exists()
    fresh = tmp_path / "fresh"
    lock = claim_run_folder(load_config(None, [f"trainer.run_dir={fresh}"]), fresh, is_main=True)
    assert (fresh / LOCK_NAME).is_file() and not list(fresh.glob("*.tmp"))
    lock.release()


# --- the run folder's own files ---------------------------------------------------------------
def test_torn_and_binary_metrics_lines_are_set_aside_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss/total": 0.5}).encode() for s in (1, 2, 3)]
    path.write_bytes(rows[0] + b"\n" + b"\xff\xfe\x00binary\n" + rows[1] + b"\n" + b"[1, 2]\n" + rows[2] + b"\n"
                     + b'{"step": 4, "loss/to')
    with caplog.at_level("WARNING", logger="vlrl"):
        _truncate_after(path, 2)
    assert path.read_bytes() == rows[0] + b"\n" + rows[1] + b"\n"
    assert f"{path}: 3 unreadable line(s) (line 2, 4, 6" in caplog.text
    bad = (tmp_path / "metrics.jsonl.bad").read_bytes()
    assert b"binary" in bad and b'"loss/to' in bad and b"[1, 2]" in bad
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_an_image_file_is_sized_before_it_is_read(tmp_path):
    huge = tmp_path / "huge.png"
    with huge.open("wb") as f:  # sparse: 3 GiB on paper, nothing on disk
        f.write(b"\x89PNG\r\n\x1a\n")
        f.truncate(3 << 30)
    t0 = time.monotonic()
    with pytest.raises(BadSample) as info:
        decode_image(huge)
    assert time.monotonic() - t0 < 1.0
    assert info.value.reason == "image_too_large" and str(huge) in str(info.value)
    assert "max_image_bytes" in str(info.value)
    with pytest.raises(BadSample, match="image_too_large"):
        decode_image(b"\x89PNG\r\n\x1a\n" + bytes(100), max_image_bytes=50)


# --- end to end under torchrun ----------------------------------------------------------------
def sft_cmd(model, data, run, steps, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "train.py",
            "--config", "configs/sft_clevr_tiny.yaml", f"model.path={model}", f"data.train_path={data}",
            f"trainer.run_dir={run}", f"trainer.max_steps={steps}", "data.prompts_per_step=4", "data.shuffle=false",
            "logging.tensorboard=false", "trainer.progress=false", *extra]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_cmd(cmd, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_never_overwrite_and_auto_on_a_used_folder(tiny_model, clevr_parquet, tmp_path):
    run = tmp_path / "run"
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 2, "checkpoint.every_steps=1", "checkpoint.keep=3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 1, "checkpoint.resume=never"))
    assert proc.returncode != 0
    assert f"error: checkpoint.resume=never, but trainer.run_dir={run} already holds a run" in proc.stderr
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 1, "checkpoint.resume=overwrite"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps_logged(run) == [1] and sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_1"]
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 2))  # auto continues the new run, not the old one
    assert proc.returncode == 0 and f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in proc.stdout
    assert steps_logged(run) == [1, 2]
    # a changed byte in a shard (hashed by either rank) stops the resume, naming the file and the way out
    for shard in (run / "checkpoints" / "step_2").glob("__*_0.distcp"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 3))
    assert proc.returncode != 0
    assert f"checkpoint {run / 'checkpoints' / 'step_2'} is damaged: __0_0.distcp does not match" in proc.stderr
    assert "__1_0.distcp does not match" in proc.stderr
    assert f"checkpoint.resume={run / 'checkpoints' / 'step_1'}" in proc.stderr
    assert (run / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.slow
def test_resume_with_a_changed_model_or_dataset_names_the_key(tiny_model, clevr_parquet, tmp_path):
    """One line naming model.path (before the model is built) or data.train_path; config.yaml stays the run's."""
    from tools.make_dataset import make_dataset
    from tools.make_tiny_model import make_tiny_model

    run = tmp_path / "run"
    proc = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 1, "checkpoint.every_steps=1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (run / "config.yaml").read_bytes()
    other_model = make_tiny_model(tmp_path / "qwen2_vl", family="qwen2_vl", size="tiny", seed=0)
    fewer_rows = make_dataset("clevr", 40, 0, tmp_path / "fewer.parquet", size=(56, 56), max_objects=4)
    for model, data, key in ((other_model, clevr_parquet, f"model.path={other_model}"),
                             (tiny_model, fewer_rows, f"data.train_path={fewer_rows} has 40 rows")):
        proc = run_cmd(sft_cmd(model, data, run, 2))
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {key}"), proc.stderr[-3000:]
        assert f'File "{ROOT / "grpo"}' not in proc.stderr  # no worker traceback (torchrun prints its own)
        assert (run / "config.yaml").read_bytes() == config
    assert steps_logged(run) == [1]


@pytest.mark.slow
def test_second_trainer_is_refused_and_workers_die_with_their_launcher(tiny_model, clevr_parquet, tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(sft_cmd(tiny_model, clevr_parquet, run, 100000), cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 240
        while not steps_logged(run) and first.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert steps_logged(run), "the first trainer never logged a step"
        holder = json.loads((run / LOCK_NAME).read_text())
        workers = children(first.pid)
        assert holder["pid"] in workers and len(workers) == 2

        second = run_cmd(sft_cmd(tiny_model, clevr_parquet, run, 3))
        assert second.returncode != 0
        assert f"is in use by PID {holder['pid']} on host {holder['host']}" in second.stderr

        os.kill(first.pid, signal.SIGKILL)  # the launcher only
        first.wait(timeout=30)
        end = time.monotonic() + 120
        while any(running(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(running(w) for w in workers), "workers outlived their launcher"
        out, err = first.communicate(timeout=30)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stopped = steps_logged(run)[-1]
    # prctl's SIGTERM can stop a worker before its watcher thread (polling each second) prints its line
    assert ("the launcher (PID" in err or "received SIGTERM" in err) and f"preempted at step {stopped}" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"
    assert not (run / LOCK_NAME).exists()


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_and_the_launcher_exits_1(tiny_model, clevr_parquet, tmp_path):
    """What the README's exit-code paragraph says: the workers stop with a checkpoint and exit 0, torchrun
    itself exits 1 (its SignalException), so the `preempted` line is what tells a preemption went well."""
    run = tmp_path / "run"
    proc = subprocess.Popen(sft_cmd(tiny_model, clevr_parquet, run, 100000), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 240
        while not steps_logged(run) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        assert steps_logged(run), "the trainer never logged a step"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stopped = steps_logged(run)[-1]
    assert proc.returncode == 1, err[-3000:]
    assert f"preempted at step {stopped}; checkpoint written: {run / 'checkpoints' / f'step_{stopped}'}" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"
