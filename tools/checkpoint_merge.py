"""Turn a resume checkpoint into a Hugging Face model folder.

    python tools/checkpoint_merge.py --checkpoint runs/X/checkpoints/step_N --out merged/

The output (config.json, model.safetensors, tokenizer, processor and chat template files) loads
with `AutoModelForImageTextToText.from_pretrained` and vLLM as is. Runs in one process with no
process group: the checkpoint's DCP shards are read straight into an unsharded model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo.checkpoint import is_complete, load_full_model_state  # noqa: E402
from models.policy import export_hf_folder, load_model_config  # noqa: E402


def merge_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Checkpoint folder → HF folder; returns `out`."""
    from transformers import AutoModelForImageTextToText

    ckpt = Path(checkpoint)
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no .metadata / trainer_state.json)")
    config = load_model_config(str(ckpt))
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    load_full_model_state(ckpt, model)
    tensors = ((n, t.to(dtype) if dtype else t) for n, t in model.state_dict().items())
    return export_hf_folder(tensors, config, str(ckpt), out, is_main=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step_N folder of a run")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    out = merge_checkpoint(args.checkpoint, args.out, dtype)
    print(f"merged {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
