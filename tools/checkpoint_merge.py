"""Turn a resume checkpoint into a Hugging Face model folder.

    python tools/checkpoint_merge.py --checkpoint runs/X/checkpoints/step_N --out merged/

The output (config.json, model.safetensors, tokenizer, processor and chat template files) loads
with `AutoModelForImageTextToText.from_pretrained` and vLLM as is. Runs in one process with no
process group: the checkpoint is verified against its manifest (sizes and sha256), then its DCP
shards are read straight into an unsharded model. A LoRA run's checkpoint (it holds `lora.json`) has
its adapters folded in, W + (alpha / rank)·B·A: the output has only the base model's names.

`--out` is written only where nothing of a run or of a user can be lost:
- never inside a run folder (one holding `run.lock`, `metrics.jsonl` or checkpoints), nor at, in
  or around the checkpoint, nor at the current folder or one that holds it (`--out .`, `..`, `/`);
- a new or empty folder is written; a folder with files in it is replaced only with `--overwrite`,
  and only when an earlier merge wrote it: the merge leaves `.vlrl-merge.json` listing the files
  it wrote, and a folder without it, or holding anything it does not list, is refused by name.
The folder is written under a temporary sibling name and renamed into place when complete, so a
failed merge leaves `--out` as it was. Its files follow the umask, like those of any other tool.
Exit status 2 names what was refused, 1 another error (a write that failed); one line either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo.checkpoint import CheckpointError, is_complete, load_full_model_state, read_lora  # noqa: E402
from models.lora import apply_lora, merge_lora  # noqa: E402
from models.policy import export_hf_folder, load_model_config  # noqa: E402

MARKER = ".vlrl-merge.json"  # written last into every merged folder: the files the merge wrote there
_RUN_FILES = ("run.lock", "metrics.jsonl")


def _run_mark(folder: Path) -> str | None:
    """What makes `folder` a run folder (its lock, its metrics, its checkpoints), or None."""
    try:
        for name in _RUN_FILES:
            if os.path.lexists(folder / name):
                return name
        ckpts = folder / "checkpoints"
        if ckpts.is_dir() and (os.path.lexists(ckpts / "latest") or any(ckpts.glob("step_*"))):
            return "checkpoints/"
    except OSError:  # an unreadable ancestor holds no run we could see
        return None
    return None


def _shown(names: list[str]) -> str:
    return f"{len(names)} entries: " + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _not_merged(target: Path, entries: list[str]) -> tuple[list[str], bool]:
    """Entries of `target` that no merge wrote, and whether `target` carries a merge's marker."""
    marker = target / MARKER
    try:
        listed = set(json.loads(marker.read_text())["files"]) if marker.is_file() and not marker.is_symlink() else None
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if listed is None:
        return entries, False
    foreign = [e for e in entries if e != MARKER and (e not in listed or (target / e).is_symlink()
                                                      or not (target / e).is_file())]
    return foreign, True


def check_out(checkpoint: Path, out: Path, overwrite: bool) -> Path:
    """The resolved output folder, after refusing any whose contents the merge could destroy."""
    ckpt, target, here = checkpoint.resolve(), out.resolve(), Path.cwd().resolve()
    if target == here or target in here.parents:
        raise FileExistsError(f"--out {out} is {target}, the current folder or one holding it; name a new folder "
                              "instead (e.g. --out merged)")
    if target == ckpt or target in ckpt.parents or ckpt in target.parents:
        raise FileExistsError(f"--out {out} is, holds or is inside the checkpoint {checkpoint}; choose a folder "
                              "outside it")
    for folder in (target, *target.parents):
        mark = _run_mark(folder)
        if mark:
            raise FileExistsError(f"--out {out} is inside the run folder {folder} (it holds {mark}); the merge never "
                                  "writes into a run folder: choose a folder outside it")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a folder")
    entries = sorted(os.listdir(target)) if target.is_dir() else []
    if not entries:
        return target
    if not overwrite:
        raise FileExistsError(f"--out {out} is not empty ({_shown(entries)}); nothing was written. Choose a new "
                              "folder, or pass --overwrite to replace a folder an earlier merge wrote")
    foreign, marked = _not_merged(target, entries)
    if not marked:
        raise FileExistsError(f"--out {out} holds files no merge wrote ({_shown(entries)}; no {MARKER}); "
                              "--overwrite replaces only a folder an earlier merge wrote. Nothing was written: "
                              "choose a new or empty folder")
    if foreign:
        raise FileExistsError(f"--out {out} was written by an earlier merge but also holds {_shown(foreign)}, which "
                              "the merge did not write; nothing was written. Move them out or choose a new folder")
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _finish_draft(draft: Path, ckpt: Path) -> None:
    """Write the marker listing the merge's files, and give every entry the umask's permissions
    (safetensors writes 0600 and the temporary folder is 0700)."""
    files = sorted(p.name for p in draft.iterdir())
    (draft / MARKER).write_text(json.dumps({"written_by": "tools/checkpoint_merge.py",
                                            "checkpoint": str(ckpt.resolve()), "files": files}, indent=1))
    mask = _umask()
    for path in draft.iterdir():
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    os.chmod(draft, 0o777 & ~mask)


def _move_into_place(draft: Path, target: Path) -> None:
    """`draft` becomes `target`; an existing `target` is set aside first and removed only after the rename."""
    if not target.exists():
        os.replace(draft, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
    os.replace(target, aside)  # onto the empty folder just made for it
    os.replace(draft, target)
    shutil.rmtree(aside, ignore_errors=True)


def merge_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                     overwrite: bool = False) -> Path:
    """Checkpoint folder → HF folder; returns `out`. See the module docstring for what is refused."""
    from transformers import AutoModelForImageTextToText

    ckpt, out = Path(checkpoint), Path(out)
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no .metadata / trainer_state.json)")
    target = check_out(ckpt, out, overwrite)
    config = load_model_config(str(ckpt))
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    lora = read_lora(ckpt)
    if lora is not None:  # a LoRA run: load base weights and adapters, then fold W + (alpha/rank)·B·A
        apply_lora(model, lora["modules"], lora["rank"], lora["alpha"])
    load_full_model_state(ckpt, model)  # verifies the checkpoint first
    if lora is not None:
        merge_lora(model)
    tensors = ((n, t.to(dtype) if dtype else t) for n, t in model.state_dict().items())
    target.parent.mkdir(parents=True, exist_ok=True)
    draft = Path(tempfile.mkdtemp(prefix=f".{target.name}.merging-", dir=target.parent))
    try:
        export_hf_folder(tensors, config, str(ckpt), draft, is_main=True)
        _finish_draft(draft, ckpt)
        check_out(ckpt, out, overwrite)  # again: the folder may have changed while the merge ran
        _move_into_place(draft, target)
    finally:
        shutil.rmtree(draft, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N folder of a run")
    parser.add_argument("--out", required=True, help="output folder: new or empty, outside any run folder")
    parser.add_argument("--overwrite", action="store_true", help="replace --out when an earlier merge wrote it")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        out = merge_checkpoint(args.checkpoint, args.out, dtype, overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: merging {args.checkpoint} into {args.out} failed: {exc}", file=sys.stderr)
        return 1
    print(f"merged {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
