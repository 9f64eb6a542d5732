"""One owner per run folder, and a start that never writes over a run it was not told to replace.

`claim_run_folder` runs once at start, before any model is built (collective; rank 0 decides):
  1. takes `<run_dir>/run.lock`: an exclusive `flock` on that file, held open for the run's life.
     The kernel releases it when the holder exits or dies (kill -9 included), so no PID is ever
     judged alive or dead, and the same holds for a second trainer in another PID namespace or
     container on the same machine. The file also names the holder's PID, host and start time,
     for the message a second trainer gets. On a network filesystem the lock is only as good as
     the filesystem's own locking (see the README);
  2. checks `logging.backends` (known names, their packages installed);
  3. checks `checkpoint.resume` against what the folder holds: `never` refuses a folder that
     already holds a run (metrics rows or step folders), `auto` refuses step folders of which
     none is complete, `overwrite` deletes the files vlrl wrote for the old run (see
     `overwrite_run`) and starts at step 0 with new tracker runs; a value that is neither one of
     these nor an existing path is refused with the list of values;
  4. refuses a checkpoint to resume whose config.json differs from `model.path`'s.
The trainer's resume refuses a data position saved for a dataset of another size
(`check_resume_data`), and `write_config` writes the resolved `config.yaml` once resume has
succeeded, so a refused or failed start leaves the earlier run's config as it was.
"""

from __future__ import annotations

import atexit
import difflib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.checkpoint import CheckpointError, resolve_resume
from grpo.config import Config, save_config
from grpo.trackers import IDS_FILE, check_trackers, tensorboard_files

log = logging.getLogger("vlrl")
LOCK_NAME = "run.lock"
RESUME_VALUES = ("auto", "never", "overwrite")
# Files vlrl writes at the top of a run folder that `overwrite` removes (config.yaml is replaced
# once the new run has resumed; run.lock is the new run's own).
RUN_FILES = ("metrics.jsonl", "metrics.jsonl.bad", "metrics.jsonl.tmp", IDS_FILE, IDS_FILE + ".tmp")
# What a save writes in `checkpoints/`: step folders, their temporary names, the `latest` pointer.
_CHECKPOINT_FOLDER = re.compile(r"^step_\d+((\.old)?\.tmp)?$")
_CHECKPOINT_FILE = re.compile(r"^latest(\.tmp)?$")
# In `tensorboard/`, besides the event files the writer recorded: tools/plot_metrics.py's default output.
_TENSORBOARD_FILES = ("curves.png",)
_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunFolderError(RuntimeError):
    """The run folder cannot be used as asked (held by another trainer, or holding a run to keep)."""


# --- the lock -------------------------------------------------------------------------------------
_HELD: dict[str, RunLock] = {}  # run.lock paths this process holds (a second Trainer in one process)


class RunLock:
    """An exclusive flock on `<run_dir>/run.lock`, held by an open descriptor until `release`."""

    def __init__(self, path: Path, fd: int, holder: dict):
        self.path = path
        self.fd: int | None = fd
        self.holder = holder
        self.users = 1
        self._pid = os.getpid()  # a forked child inherits the object but must not release it

    @staticmethod
    def me() -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take the folder's lock, or raise RunFolderError naming its holder. Never blocks."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        held = _HELD.get(os.path.realpath(path))
        if held is not None and held.fd is not None:
            held.users += 1
            return held
        for _ in range(100):
            fd = _open_lock(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = _read_fd(fd)
                os.close(fd)
                raise RunFolderError(_held_message(path, text)) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in _LOCK_UNSUPPORTED:
                    raise RunFolderError(
                        f"{path}: the filesystem of trainer.run_dir does not support file locks ({exc.strerror}), so "
                        "vlrl cannot make sure one trainer owns the folder; put trainer.run_dir on a filesystem "
                        "that supports flock (a local disk, or NFS with locking enabled)") from None
                raise RunFolderError(f"{path}: taking the lock failed ({exc.strerror})") from None
            if _same_file(fd, path):
                return cls._hold(path, fd)
            os.close(fd)  # its holder removed the file between our open and lock: lock the new one
        raise RunFolderError(f"{path}: could not take the lock (it kept being replaced); another trainer is starting "
                             "in this folder. Use a different trainer.run_dir")

    @classmethod
    def _hold(cls, path: Path, fd: int) -> RunLock:
        """This process holds the lock on `fd`: note what the file said, then write this holder in it."""
        previous = _read_fd(fd)
        me = cls.me()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            raise RunFolderError(f"{path}: writing the lock file failed ({exc.strerror}); choose a trainer.run_dir "
                                 "this user can write, on a disk with space") from None
        if previous.strip():
            log.warning("%s: taking over the lock left by %s, which ended without removing it (no process holds "
                        "it)", path, _describe_holder(previous))
        lock = cls(path, fd, me)
        _HELD[os.path.realpath(path)] = lock
        return lock

    def release(self) -> None:
        """Remove the lock file and drop the lock (after the last user in this process releases)."""
        if self.fd is None or os.getpid() != self._pid:
            return
        self.users -= 1
        if self.users > 0:
            return
        _HELD.pop(os.path.realpath(self.path), None)
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)  # while still locked: a contender that opened it sees it gone and retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def scratch_run_dir(tool: str) -> Path:
    """A run folder for a tool that builds a trainer but keeps nothing (logprob_check, op_diff): one per
    launch, shared by its ranks (torchrun gives them one MASTER_PORT; a plain process uses its PID), so two
    launches at once do not contend for one folder's lock. Rank 0 deletes it when its process exits."""
    import tempfile

    tag = os.environ.get("MASTER_PORT") or str(os.getpid())
    path = Path(tempfile.gettempdir()) / f"vlrl_{tool}_{tag}"
    if os.environ.get("RANK", "0") == "0" and path not in _SCRATCH:
        _SCRATCH.add(path)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_SCRATCH: set[Path] = set()


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock.users = 1
        lock.release()


def _open_lock(path: Path) -> int:
    """Open (or create) the lock file; refuse anything but a regular file, and never follow a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise RunFolderError(_not_a_lock(path, st))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):  # replaced since the lstat above
            raise RunFolderError(_not_a_lock(path, os.lstat(path))) from None
        raise RunFolderError(f"{path}: cannot open the run folder's lock file ({exc.strerror}); choose a "
                             "trainer.run_dir this user can write") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunFolderError(_not_a_lock(path, os.lstat(path)))
    return fd


def _not_a_lock(path: Path, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        what = f"a symbolic link (to {os.readlink(path)})"
    elif stat.S_ISDIR(st.st_mode):
        what = "a directory"
    else:
        what = "not a regular file"
    return (f"{path} is {what}, not the lock file vlrl writes (a plain file it makes itself); vlrl does not use it. "
            f"Remove it and start again, or set trainer.run_dir to another folder")


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _read_fd(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")


def _holder(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


def _describe_holder(text: str) -> str:
    holder = _holder(text)
    if holder is None:
        return f"an unreadable holder ({text.strip()[:60]!r})"
    return f"PID {holder.get('pid')} on host {holder.get('host')}"


def _held_message(path: Path, text: str) -> str:
    holder = _holder(text)
    if holder is None:
        who = "another process, which has not written its name in the lock file (it may be starting)"
    else:
        who = f"PID {holder.get('pid')} on host {holder.get('host')} (since {holder.get('started', '?')})"
    return (f"trainer.run_dir={path.parent} is in use by {who}: it holds the lock on {path}, which the kernel "
            "releases when that process ends. Wait for that run to end or stop it, or set trainer.run_dir to "
            "another folder")


# --- what the folder holds ------------------------------------------------------------------------
def _metrics_rows(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except (FileNotFoundError, IsADirectoryError):
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


def _entry_problem(path: Path, run_dir: Path, want_dir: bool) -> str | None:
    """Why `path` (one of vlrl's names) is not vlrl's to delete: a link, or the wrong kind; None if it is."""
    name = path.relative_to(run_dir)
    if path.is_symlink():
        return f"{name} (a symbolic link to {os.readlink(path)})"
    if want_dir != path.is_dir() or not (path.is_dir() or path.is_file()):
        return f"{name} (not a {'folder' if want_dir else 'regular file'})"
    return None


def _folder_plan(run_dir: Path, name: str, own) -> tuple[list[Path], list[str]]:
    """vlrl's entries of `run_dir/name` (per `own(entry) -> want_dir or None`) and what else is there."""
    folder = run_dir / name
    if not os.path.lexists(folder):
        return [], []
    problem = _entry_problem(folder, run_dir, want_dir=True)
    if problem:
        return [], [problem]
    delete, foreign = [], []
    for entry in sorted(folder.iterdir()):
        want_dir = own(entry.name)
        problem = f"{entry.relative_to(run_dir)}" if want_dir is None else _entry_problem(entry, run_dir, want_dir)
        (foreign.append(problem) if problem else delete.append(entry))
    return delete, foreign


def overwrite_plan(run_dir: Path) -> tuple[list[Path], list[str]]:
    """What `checkpoint.resume=overwrite` deletes, and the entries that stop it.

    vlrl's own: the RUN_FILES, and in `checkpoints/` the step folders, their temporary names and the
    `latest` pointer, and in `tensorboard/` the event files vlrl's writer recorded in trackers.json
    and the plot tools/plot_metrics.py writes there (curves.png).
    Anything else in those two folders, and any of these names that is a symbolic link or of the
    wrong kind, stops it. `wandb/` and `mlflow/` stay: they are tracker stores in which the new run
    is a run of its own. Other files at the top of the folder are not touched.
    """
    delete, foreign = [], []
    for name in RUN_FILES:
        path = run_dir / name
        if os.path.lexists(path):
            problem = _entry_problem(path, run_dir, want_dir=False)
            (foreign.append(problem) if problem else delete.append(path))

    def checkpoint_entry(entry: str) -> bool | None:
        return True if _CHECKPOINT_FOLDER.match(entry) else False if _CHECKPOINT_FILE.match(entry) else None

    recorded = {*tensorboard_files(run_dir), *_TENSORBOARD_FILES}
    for name, own in (("checkpoints", checkpoint_entry),
                      ("tensorboard", lambda entry: False if entry in recorded else None)):
        more, other = _folder_plan(run_dir, name, own)
        delete += more
        foreign += other
    return delete, foreign


def overwrite_run(run_dir: Path) -> list[str]:
    """Delete exactly what vlrl wrote for the earlier run (see `overwrite_plan`); return what went.

    Refuses, deleting nothing, when `checkpoints/` or `tensorboard/` hold anything else or a name
    of vlrl's is a symbolic link. Forgetting trackers.json makes the trackers start new runs.
    """
    delete, foreign = overwrite_plan(run_dir)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise RunFolderError(
            f"checkpoint.resume=overwrite: trainer.run_dir={run_dir} holds what vlrl did not write: {shown}; nothing "
            "was deleted. vlrl deletes only its own files and never through a link; move these out of the run "
            "folder, or set trainer.run_dir to a new folder")
    gone = []
    for path in delete:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            raise RunFolderError(f"checkpoint.resume=overwrite: deleting {path} failed ({exc.strerror}); deleted "
                                 f"so far: {', '.join(gone) or 'nothing'}. Fix its permissions and start "
                                 "again") from None
        gone.append(str(path.relative_to(run_dir)))
    for name in ("checkpoints", "tensorboard"):
        try:
            (run_dir / name).rmdir()  # only when now empty
        except OSError:
            pass
    return gone


def _resume_value_error(resume: str) -> str | None:
    """A message for a `checkpoint.resume` that is neither a value nor an existing path (a typo)."""
    if resume in RESUME_VALUES or os.path.lexists(resume):
        return None
    close = difflib.get_close_matches(resume, RESUME_VALUES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"config key 'checkpoint.resume' is {resume!r}{hint}: it must be one of {', '.join(RESUME_VALUES)}, or "
            "the path of a checkpoint folder (RUN/checkpoints/step_N), and no such path exists")


def check_resume(resume: str, run_dir: Path) -> Path | None:
    """Refuse a start that would write over an earlier run; carry out `overwrite`. Rank 0 only.

    Returns the checkpoint the run will resume from, or None for a start at step 0.
    """
    typo = _resume_value_error(resume)
    if typo:
        raise RunFolderError(typo)
    if resume == "overwrite":
        found = held_run(run_dir)
        gone = overwrite_run(run_dir)
        if gone:
            log.warning("checkpoint.resume=overwrite: deleted the earlier run in %s (%s): %s", run_dir,
                        "; ".join(found) or "no metrics rows or step folders", ", ".join(gone))
        return None
    if resume == "never":
        found = held_run(run_dir)
        if found:
            raise RunFolderError(
                f"checkpoint.resume=never, but trainer.run_dir={run_dir} already holds a run ({'; '.join(found)}); "
                "nothing was changed. Continue it with checkpoint.resume=auto, start over in it with "
                "checkpoint.resume=overwrite (deletes the checkpoints, metrics and TensorBoard logs vlrl wrote), or "
                "set trainer.run_dir to a new folder"
            )
        return None
    try:
        latest = resolve_resume(resume, run_dir)  # auto: raises on step folders with none complete
    except FileNotFoundError as exc:  # a PATH that is not a complete checkpoint
        raise RunFolderError(str(exc)) from None
    rows = _metrics_rows(run_dir / "metrics.jsonl")
    if resume == "auto" and latest is None and rows:
        raise RunFolderError(
            f"checkpoint.resume=auto: trainer.run_dir={run_dir} holds metrics.jsonl with {rows} rows but no "
            "checkpoint to continue from, and starting at step 0 would replace them; nothing was changed. Start over "
            "in it with checkpoint.resume=overwrite, or set trainer.run_dir to a new folder"
        )
    return latest


# --- resume against the run's inputs -------------------------------------------------------------
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}


def _flat(config: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(config, dict):
        return {prefix.rstrip("."): config}
    flat = {}
    for key, value in config.items():
        if key not in _VOLATILE_CONFIG_KEYS:
            flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_resume_model(checkpoint: Path, model_path: str) -> None:
    """Refuse to resume a checkpoint into a different model, naming `model.path`.

    Compares the checkpoint's copy of config.json with `model_path`'s (names, dtype and versions aside).
    """
    theirs, mine = _read_json(checkpoint / "config.json"), _read_json(Path(model_path) / "config.json")
    if not (isinstance(theirs, dict) and isinstance(mine, dict)):
        return
    a, b = _flat(theirs), _flat(mine)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, "absent") != b.get(k, "absent"))
    if changed:
        shown = "; ".join(f"{k} is {a.get(k, 'absent')} there, {b.get(k, 'absent')} here" for k in changed[:3])
        raise CheckpointError(
            f"model.path={model_path} is not the model checkpoint {checkpoint} was trained from ({shown}); nothing "
            "was loaded or changed. Set model.path to that model, or start over with checkpoint.resume=overwrite "
            "or a new trainer.run_dir")


def check_resume_data(checkpoint: Path, dataset_rows: int, train_path: str) -> None:
    """Refuse to resume a data position saved for a dataset of another size, naming `data.train_path`."""
    state = _read_json(checkpoint / "trainer_state.json")
    data = state.get("data") if isinstance(state, dict) else None
    stream = data.get("stream") if isinstance(data, dict) else None
    rows = stream.get("size") if isinstance(stream, dict) else None
    if isinstance(rows, int) and rows != dataset_rows:
        raise CheckpointError(
            f"data.train_path={train_path} has {dataset_rows} rows, but checkpoint {checkpoint} holds a position in "
            f"a dataset of {rows} rows; nothing was loaded or changed. Set data.train_path to the data the run was "
            "trained on, or start over with checkpoint.resume=overwrite or a new trainer.run_dir")


# --- start-up, collective ------------------------------------------------------------------------
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
    """Lock the run folder, check the trackers, `checkpoint.resume` against it and the checkpoint
    to resume against `model.path`; collective.

    Every rank raises the same RunFolderError when rank 0 refuses. Returns the lock on rank 0,
    None elsewhere. config.yaml is written later, by `write_config`, once resume has succeeded.
    """
    lock, error = None, ""
    if is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock.acquire(run_dir)
            check_trackers(cfg.logging.backends, cfg.logging.tensorboard)
            latest = check_resume(cfg.checkpoint.resume, run_dir)
            if latest is not None:
                check_resume_model(latest, cfg.model.path)
        except (RuntimeError, ValueError) as exc:  # RunFolderError, CheckpointError, trackers: one line each
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


def write_config(cfg: Config, run_dir: Path, is_main: bool) -> None:
    """Write the resolved config.yaml (temporary name, atomic rename) on rank 0; collective."""
    error = ""
    if is_main:
        draft = run_dir / "config.yaml.tmp"
        try:
            save_config(cfg, draft)
            os.replace(draft, run_dir / "config.yaml")
        except OSError as exc:
            error = f"trainer.run_dir={run_dir}: writing config.yaml failed ({exc}); choose a folder this user can write"
    error = _broadcast_text(error)
    if error:
        raise RunFolderError(error)
