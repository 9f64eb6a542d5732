"""Resume checkpoints with torch.distributed.checkpoint (every rank writes its own shards).

Layout: `<run_dir>/checkpoints/step_<N>/` holds the DCP shards of model and optimizer, one
`rng_rank<R>.safetensors` per rank, `trainer_state.json` (step, data position, counters) and a
copy of the model folder's config/processor/tokenizer files so `tools/checkpoint_merge.py` needs
nothing else. A checkpoint is written under `step_<N>.tmp`, renamed when complete, and only then
named by the `latest` pointer: a crash mid-write never leaves a checkpoint that looks complete.
Nothing here is loaded with pickle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from models.policy import _SIDE_FILES


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


FAULT_ENV = "VLRL_FAULT_AT"
FAULT_PHASES = ("before_dcp", "after_dcp", "after_state", "after_rename")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _fault_point(phase: str, step: int) -> None:
    """Test hook: `VLRL_FAULT_AT=PHASE[@STEP]` kills this process with SIGKILL at that write phase.

    Phases, in order: before_dcp (temporary folder made, no shards yet; every rank), after_dcp
    (shards and RNG written, before trainer_state.json; rank 0), after_state (before the rename;
    rank 0), after_rename (renamed, before the `latest` pointer; rank 0). The fault-injection
    tests use it to check that a crash at any point leaves the last complete checkpoint usable.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name not in FAULT_PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown phase {name!r}; phases: {', '.join(FAULT_PHASES)}")
    if name == phase and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the data files are synced
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove_stale(root: Path) -> None:
    """Drop leftovers of interrupted saves (`*.tmp`); they are never complete checkpoints."""
    for leftover in root.glob("*.tmp"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _agree(ok: bool) -> bool:
    """True when every rank succeeded; replaces a barrier so a failed rank cannot hang the others."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def save_checkpoint(run_dir, step: int, model, optimizer, trainer_state: dict, model_path: str, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step`; collective over all ranks.

    Order (each step durable before the next): shards + RNG + trainer_state.json in
    `step_N.tmp`, fsync, rename to `step_N`, fsync the folder, then the `latest` pointer by an
    atomic replace. A crash at any point leaves the previous complete checkpoint and pointer as
    they were. A write error (disk full, ...) raises OSError naming the folder on every rank,
    after removing the partial folder; the previous checkpoint stays `latest`.
    """
    root = Path(run_dir) / "checkpoints"
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp.mkdir()
        except OSError as exc:
            error = exc
    if _agree(error is None):
        _fault_point("before_dcp", step)
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            rng_file = tmp / f"rng_rank{rank}.safetensors"
            save_file(_rng_state(), str(rng_file))
            _fsync_file(rng_file)
        except OSError as exc:  # DCP raises its own exception type on every rank when one rank fails
            error = exc
        except Exception as exc:  # noqa: BLE001 - reported below with the folder's name
            error = exc
    if _agree(error is None) and rank == 0:
        try:
            _finish(root, tmp, final, step, trainer_state, model_path, keep)
        except OSError as exc:
            error = exc
    if not _agree(error is None):
        _fail(root, tmp, error)
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, trainer_state: dict, model_path: str, keep: int) -> None:
    """Rank 0: trainer state and side files, then make the checkpoint visible (rename, pointer)."""
    _fault_point("after_dcp", step)
    _write_durable(tmp / "trainer_state.json", json.dumps({**trainer_state, "step": step}, indent=1))
    for name in ("config.json", *_SIDE_FILES):
        src = Path(model_path) / name
        if src.is_file():
            shutil.copyfile(src, tmp / name)
            _fsync_file(tmp / name)
    _fsync_dir(tmp)
    _fault_point("after_state", step)
    if final.exists():  # a re-run of this step (resumed from an older checkpoint): set the old copy aside
        os.replace(final, final.with_name(final.name + ".old.tmp"))
    os.replace(tmp, final)
    _fsync_dir(root)
    _fault_point("after_rename", step)
    _write_latest(root, final.name)
    shutil.rmtree(final.with_name(final.name + ".old.tmp"), ignore_errors=True)
    _prune(root, keep)


def _fail(root: Path, tmp: Path, error: BaseException | None) -> None:
    """Every rank raises; rank 0 removes the partial folder (on a full disk that frees the space)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = find_latest(root.parent)
    kept = f"the previous checkpoint {latest} is intact and still `latest`" if latest else "no earlier checkpoint exists"
    if error is None:
        raise OSError(f"writing checkpoint {tmp} failed on another rank (see its log); {kept}")
    detail = f"{type(error).__name__}: {error}"
    err = getattr(error, "errno", None)
    raise OSError(err, f"writing checkpoint {tmp} failed ({detail}); {kept}. Free space or point "
                       f"trainer.run_dir elsewhere, then resume with checkpoint.resume=auto") from error


def _write_latest(root: Path, name: str) -> None:
    tmp = root / "latest.tmp"
    _write_durable(tmp, name + "\n")
    os.replace(tmp, root / "latest")
    _fsync_dir(root)


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted((p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(path: Path) -> bool:
    """A finished checkpoint folder: named step_N (not *.tmp), with DCP metadata and trainer state."""
    return path.is_dir() and _step_of(path) is not None and (path / "trainer_state.json").is_file() and (
        path / ".metadata"
    ).is_file()


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder: the one `latest` names, else the highest step.

    `*.tmp` folders (interrupted saves) and folders missing `.metadata` or `trainer_state.json`
    are never returned. The pointer's content is only ever a folder name inside `checkpoints/`.
    """
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and is_complete(root / name):
            return root / name
    done = [p for p in root.glob("step_*") if is_complete(p)]
    return max(done, key=_step_of) if done else None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(run_dir)
    path = Path(resume)
    if not is_complete(path):
        raise FileNotFoundError(f"checkpoint.resume={resume}: not a complete checkpoint folder")
    return path


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG; returns the trainer state dict."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng_rank{dist.get_rank()}.safetensors"
    if rng.is_file():
        _set_rng_state(load_file(str(rng)))
    return json.loads((path / "trainer_state.json").read_text())


def load_full_model_state(path: str | Path, model) -> None:
    """Fill an unsharded model (single process, no process group) from a checkpoint's model shards."""
    sd = model.state_dict()
    state = {"model": sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True) if "no_dist" in dcp.load.__code__.co_varnames else dcp.load(
        state, checkpoint_id=str(path)
    )
    model.load_state_dict(state["model"], strict=False)


__all__ = ["save_checkpoint", "load_checkpoint", "find_latest", "resolve_resume", "load_full_model_state", "StateDictOptions"]
