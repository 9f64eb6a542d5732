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
import shutil
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


def save_checkpoint(run_dir, step: int, model, optimizer, trainer_state: dict, model_path: str, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step`; collective over all ranks."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
    dist.barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
        for name in ("config.json", *_SIDE_FILES):
            src = Path(model_path) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_latest(Path(run_dir) / "checkpoints", final.name)
        _prune(Path(run_dir) / "checkpoints", keep)
    dist.barrier()
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / "latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                  key=lambda p: int(p.name.split("_")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".tmp") and (path / "trainer_state.json").is_file() and (
        path / ".metadata"
    ).is_file()


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder, following `latest`, else scanning."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if is_complete(cand):
            return cand
    done = [p for p in root.glob("step_*") if is_complete(p)]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


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
