"""One owner per run folder, and a start that never writes over a run it was not told to replace.

`claim_run_folder` runs once at start, before any model is built (collective; rank 0 decides):
  1. takes `<run_dir>/run.lock`, a JSON file naming the PID, host and start time of the trainer
     that owns the folder. A second trainer fails naming the holder. A lock left by a process
     that no longer runs on this host (kill -9, a crashed node's restart) is taken over with a
     warning; one from another host is never assumed dead;
  2. checks `checkpoint.resume` against what the folder holds: `never` refuses a folder that
     already holds a run (metrics rows or step folders), `auto` refuses step folders of which
     none is complete, `overwrite` deletes the old run's checkpoints, metrics and TensorBoard
     logs and starts at step 0;
  3. writes the resolved `config.yaml` through a temporary name and an atomic rename.
The lock is released when the process exits (atexit); a process killed hard leaves it for the
next start on this host to take over.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.checkpoint import resolve_resume
from grpo.config import Config, save_config

log = logging.getLogger("vlrl")
LOCK_NAME = "run.lock"


class RunFolderError(RuntimeError):
    """The run folder cannot be used as asked (held by another trainer, or holding a run to keep)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused PID apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    started = holder.get("start_time")
    return started is None or _start_time(pid) in (None, started)


class RunLock:
    """`<run_dir>/run.lock`, created atomically (a hard link of a complete file), removed on exit."""

    def __init__(self, path: Path, holder: dict):
        self.path = path
        self.holder = holder
        atexit.register(self.release)

    @staticmethod
    def me() -> dict:
        pid = os.getpid()
        return {"pid": pid, "host": socket.gethostname(), "start_time": _start_time(pid),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        me = cls.me()
        draft = run_dir / f"{LOCK_NAME}.{me['pid']}.tmp"
        draft.write_text(json.dumps(me) + "\n")
        try:
            for _ in range(3):
                try:
                    os.link(draft, path)  # fails if the lock exists: creation and content in one step
                    return cls(path, me)
                except FileExistsError:
                    pass
                holder = _read_holder(path)
                if holder is None:
                    continue  # removed meanwhile: try again
                if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                    return cls(path, holder)  # this process already owns it (a second Trainer in one process)
                if holder.get("host") != me["host"] or _alive(holder):
                    raise RunFolderError(_held_message(path, holder))
                _set_aside(path, holder)
            raise RunFolderError(f"{path}: could not take the lock (it kept changing); another trainer is starting "
                                 "in this folder. Use a different trainer.run_dir")
        finally:
            draft.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it still names this process."""
        holder = _read_holder(self.path)
        if holder and holder.get("pid") == self.holder["pid"] and holder.get("host") == self.holder["host"]:
            self.path.unlink(missing_ok=True)


def _read_holder(path: Path) -> dict | None:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        if isinstance(holder, dict):
            return holder
    except ValueError:
        pass
    raise RunFolderError(f"{path} is not a lock this trainer wrote ({text[:80]!r}). If no trainer is running in "
                         f"{path.parent}, delete {path} and start again")


def _held_message(path: Path, holder: dict) -> str:
    return (f"trainer.run_dir={path.parent} is in use by PID {holder.get('pid')} on host {holder.get('host')} "
            f"(since {holder.get('started', '?')}; lock file {path}). Wait for that run to end or stop it, or set "
            f"trainer.run_dir to another folder. If that process is gone (e.g. its host died), delete {path}")


def _set_aside(path: Path, holder: dict) -> None:
    """Take over the lock of a dead process: rename it away (only one contender's rename succeeds)."""
    try:
        os.rename(path, path.with_name(f"{LOCK_NAME}.stale"))
    except FileNotFoundError:
        return  # another contender took it first; the next link attempt decides
    log.warning("%s: taking over the lock of PID %s on %s, which is no longer running", path, holder.get("pid"),
                holder.get("host"))


def _metrics_rows(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def held_run(run_dir: Path) -> list[str]:
    """What in `run_dir` belongs to an earlier run: metrics rows and step folders (empty if none)."""
    found = []
    rows = _metrics_rows(run_dir / "metrics.jsonl")
    if rows:
        found.append(f"metrics.jsonl with {rows} rows")
    root = run_dir / "checkpoints"
    steps = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    if steps:
        found.append(f"checkpoints {', '.join(steps)}")
    return found


def check_resume(resume: str, run_dir: Path) -> None:
    """Refuse a start that would write over an earlier run; carry out `overwrite`. Rank 0 only."""
    if resume == "overwrite":
        found = held_run(run_dir)
        for name in ("checkpoints", "tensorboard"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        if found:
            log.warning("checkpoint.resume=overwrite: deleted the earlier run in %s (%s)", run_dir, "; ".join(found))
        return
    if resume == "never":
        found = held_run(run_dir)
        if found:
            raise RunFolderError(
                f"checkpoint.resume=never, but trainer.run_dir={run_dir} already holds a run ({'; '.join(found)}); "
                "nothing was changed. Continue it with checkpoint.resume=auto, start over in it with "
                "checkpoint.resume=overwrite (deletes its checkpoints, metrics and TensorBoard logs), or set "
                "trainer.run_dir to a new folder"
            )
        return
    latest = resolve_resume(resume, run_dir)  # auto: raises on step folders with none complete
    rows = _metrics_rows(run_dir / "metrics.jsonl")
    if resume == "auto" and latest is None and rows:
        raise RunFolderError(
            f"checkpoint.resume=auto: trainer.run_dir={run_dir} holds metrics.jsonl with {rows} rows but no "
            "checkpoint to continue from, and starting at step 0 would replace them; nothing was changed. Start over "
            "in it with checkpoint.resume=overwrite, or set trainer.run_dir to a new folder"
        )


def _broadcast_text(text: str) -> str:
    """Rank 0's text on every rank (raw bytes in tensors; nothing is pickled)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return text
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def claim_run_folder(cfg: Config, run_dir: Path, is_main: bool) -> RunLock | None:
    """Lock the run folder, check `checkpoint.resume` against it, write config.yaml; collective.

    Every rank raises the same RunFolderError (or the checkpoint error) when rank 0 refuses.
    Returns the lock on rank 0, None elsewhere.
    """
    lock, error = None, ""
    if is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock.acquire(run_dir)
            check_resume(cfg.checkpoint.resume, run_dir)
            draft = run_dir / "config.yaml.tmp"
            save_config(cfg, draft)
            os.replace(draft, run_dir / "config.yaml")
        except RuntimeError as exc:  # RunFolderError, CheckpointError: they name the folder already
            error = str(exc)
        except OSError as exc:
            error = f"trainer.run_dir={run_dir}: {exc}; choose a folder this user can write"
        if error and lock is not None:
            lock.release()
            lock = None
    error = _broadcast_text(error)
    if error:
        raise RunFolderError(error)
    return lock
