"""Preemption: SIGTERM/SIGINT → finish the step, checkpoint, exit 0; a second signal exits at once.

Unit tests drive `PreemptionGuard` in this process (and one subprocess for the hard exit); a
gloo test checks that one signalled rank stops them all; the end-to-end test signals one
torchrun worker of an SFT run and resumes from the checkpoint it wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from grpo.preemption import PreemptionGuard
from tests.conftest import ROOT, run_torchrun

COMPARED = ("loss/total", "loss/grad_norm", "optim/lr", "perf/tokens")


def _wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# --- the guard in this process ---------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_requests_a_stop_and_says_which_step(sig, capfd):
    before = signal.getsignal(sig)
    guard = PreemptionGuard(current_step=lambda: 7)
    try:
        assert guard.installed and not guard.should_stop() and not guard.stop_requested()
        os.kill(os.getpid(), sig)  # SIGINT would raise KeyboardInterrupt here without the guard
        _wait(guard.should_stop, 5, "the handler")
        assert guard.stop_requested() and guard.signum == sig
        err = capfd.readouterr().err
        assert f"received {sig.name}: finishing step 7, then writing a checkpoint" in err
    finally:
        guard.close()
    assert signal.getsignal(sig) is before


def test_repeat_within_the_window_is_the_same_request(capfd):
    """torchrun forwards the terminal's Ctrl-C to workers that already got it: not a second signal."""
    with PreemptionGuard(repeat_window_s=30) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        _wait(guard.should_stop, 5, "the handler")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # still alive, still one request
        assert guard.signum == signal.SIGINT
    assert capfd.readouterr().err.count("received") == 1


def test_close_restores_the_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        guard = PreemptionGuard()
        assert signal.getsignal(signal.SIGTERM) == guard._handle
        guard.close()
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(lambda: seen, 5, "the restored handler")
        assert seen == [signal.SIGTERM] and not guard.should_stop()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    made = []
    worker = threading.Thread(target=lambda: made.append(PreemptionGuard()))
    worker.start()
    worker.join()
    assert not made[0].installed and signal.getsignal(signal.SIGTERM) is before
    made[0].close()


def test_second_signal_exits_at_once():
    """After the repeat window a second signal ends the process with 128 + signum, no checkpoint."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from grpo.preemption import PreemptionGuard
        guard = PreemptionGuard(current_step=lambda: 3, repeat_window_s=0.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("first handled", guard.should_stop(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("still running", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr)
    assert "first handled True" in proc.stdout and "still running" not in proc.stdout
    assert "received SIGTERM: finishing step 3" in proc.stderr
    assert "received SIGTERM again: exiting now without writing a checkpoint" in proc.stderr


# --- agreement across ranks ------------------------------------------------------------------
def test_one_signalled_rank_stops_every_rank(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import torch.distributed as dist
        from grpo.preemption import PreemptionGuard
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        guard = PreemptionGuard(current_step=lambda: 1)
        answers = [guard.stop_requested()]
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            while not guard.should_stop():
                time.sleep(0.01)
        answers.append(guard.stop_requested())
        print(f"rank {rank} local={guard.should_stop()} agreed={answers}", flush=True)
        guard.close()
        dist.destroy_process_group()
    """))
    proc = run_torchrun([str(script)], nproc=2, timeout=300)
    assert "rank 0 local=False agreed=[False, True]" in proc.stdout, proc.stdout
    assert "rank 1 local=True agreed=[False, True]" in proc.stdout, proc.stdout


# --- end to end: signal one worker of a real run, resume from what it wrote -------------------
def sft_args(model, data, run_dir, steps):
    return ["train.py", "--config", "configs/sft_clevr_tiny.yaml", f"model.path={model}", f"data.train_path={data}",
            f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", "data.prompts_per_step=4",
            "data.shuffle=false", "logging.tensorboard=false", "trainer.progress=false"]


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The torchrun worker of `rank` among the agent's children (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_sigterm_to_one_worker_checkpoints_exits_0_and_resumes_exactly(tiny_model, clevr_parquet, tmp_path):
    run, ref = tmp_path / "run", tmp_path / "ref"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           *sft_args(tiny_model, clevr_parquet, run, 1000)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait(lambda: metric_rows(run) or proc.poll() is not None, 240, "the first step")
        pid = worker_pid(proc.pid, 1)
        assert pid is not None, "rank 1 worker not found"
        os.kill(pid, signal.SIGTERM)  # only rank 1: rank 0 must learn of it through the all-reduce
        out, err = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test created, if anything is left
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-4000:]
    rows = metric_rows(run)
    stopped = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, stopped + 1)) and stopped < 1000
    ckpt = run / "checkpoints" / f"step_{stopped}"
    assert "[rank 1] received SIGTERM: finishing step" in err
    assert f"preempted at step {stopped}; checkpoint written: {ckpt}; resume with checkpoint.resume=auto" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name

    resumed = run_torchrun(sft_args(tiny_model, clevr_parquet, run, stopped + 1))
    assert f"resumed from {ckpt} at step {stopped}" in resumed.stdout
    run_torchrun(sft_args(tiny_model, clevr_parquet, ref, stopped + 1))
    got, want = metric_rows(run), metric_rows(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, stopped + 2))
    for a, b in zip(got, want):
        for k in COMPARED:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
