"""Turn a resume checkpoint into a Hugging Face model folder.

    python tools/checkpoint_merge.py --checkpoint runs/X/checkpoints/step_N --out merged/

The output (config.json, model.safetensors, tokenizer, processor and chat template files) loads
with `AutoModelForImageTextToText.from_pretrained` and vLLM as is. Runs in one process with no
process group: the checkpoint is verified against its manifest (sizes and sha256), then its DCP
shards are read straight into an unsharded model. A LoRA run's checkpoint (it holds `lora.json`) has
its adapters folded in, W + (alpha / rank)·B·A: the output has only the base model's names.

`--out` must be a new or empty folder; a folder with files in it is replaced only with
`--overwrite`, and never when it is or holds the checkpoint. The folder is written under a
temporary sibling name and renamed into place when complete, so a failed merge leaves `--out` as
it was. Exit status 2 names what was refused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo.checkpoint import CheckpointError, is_complete, load_full_model_state, read_lora  # noqa: E402
from models.lora import apply_lora, merge_lora  # noqa: E402
from models.policy import export_hf_folder, load_model_config  # noqa: E402


def check_out(checkpoint: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output folder whose contents the merge would destroy without being told to."""
    ckpt, target = checkpoint.resolve(), out.resolve()
    if target == ckpt or target in ckpt.parents or ckpt in target.parents:
        raise FileExistsError(f"--out {out} is, holds or is inside the checkpoint {checkpoint}; choose a folder "
                              "outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; choose a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise FileExistsError(f"--out {out} is not empty ({len(entries)} entries: {shown}); nothing was written. "
                              "Pass --overwrite to replace its contents, or choose a new folder")


def _move_into_place(draft: Path, out: Path) -> None:
    """`draft` becomes `out`; an existing `out` is set aside first and removed only after the rename."""
    if not out.exists():
        os.replace(draft, out)
        return
    old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    os.replace(out, old)
    os.replace(draft, out)
    shutil.rmtree(old, ignore_errors=True)


def merge_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                     overwrite: bool = False) -> Path:
    """Checkpoint folder → HF folder; returns `out`. See the module docstring for what is refused."""
    from transformers import AutoModelForImageTextToText

    ckpt, out = Path(checkpoint), Path(out)
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no .metadata / trainer_state.json)")
    check_out(ckpt, out, overwrite)
    config = load_model_config(str(ckpt))
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    lora = read_lora(ckpt)
    if lora is not None:  # a LoRA run: load base weights and adapters, then fold W + (alpha/rank)·B·A
        apply_lora(model, lora["modules"], lora["rank"], lora["alpha"])
    load_full_model_state(ckpt, model)  # verifies the checkpoint first
    if lora is not None:
        merge_lora(model)
    tensors = ((n, t.to(dtype) if dtype else t) for n, t in model.state_dict().items())
    out.parent.mkdir(parents=True, exist_ok=True)
    draft = out.with_name(f".{out.name}.merging-{os.getpid()}")
    shutil.rmtree(draft, ignore_errors=True)
    try:
        export_hf_folder(tensors, config, str(ckpt), draft, is_main=True)
        _move_into_place(draft, out)
    finally:
        shutil.rmtree(draft, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N folder of a run")
    parser.add_argument("--out", required=True, help="output folder (new or empty, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        out = merge_checkpoint(args.checkpoint, args.out, dtype, overwrite=args.overwrite)
    except (FileExistsError, FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
