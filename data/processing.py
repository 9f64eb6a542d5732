"""From a dataset sample to model inputs: chat template + processor, once per prompt.

Images arrive canonical (RGB, sides multiples of patch × merge, within min/max pixels — see
`data.images.canonicalize_image`), so the processor is told not to resize: the trainer, not the
processor or the engine, decides every image's size. Prompts are never truncated; one longer
than the limit is rejected with a reason (cutting it would cut image tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.images import BadSample
from data.prompts import build_messages

SFT_TARGETS = {
    "clevr": "<answer>{answer}</answer>",
    "generic": "<answer>{answer}</answer>",
    "geo3k": "<think>\n</think>\n\\boxed{{{answer}}}",
}


@dataclass
class EncodedPrompt:
    """A prompt as the model sees it: expanded token ids plus processor outputs for its images."""

    index: int
    input_ids: torch.Tensor  # (L,) with image placeholders expanded
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    images: list = field(default_factory=list)
    answer: str = ""


def load_processor(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoProcessor

    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"model folder not found: {model_path}")
    return AutoProcessor.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)


def encode_prompt(processor, sample, task: str, max_prompt_tokens: int) -> EncodedPrompt:
    """Chat template + processor on one sample; raises BadSample('prompt_too_long') instead of truncating."""
    messages = build_messages(sample, task)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if sample.images:
        out = processor(text=[text], images=list(sample.images), do_resize=False, return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
    else:
        out = processor(text=[text], return_tensors="pt")
        pixel_values, grid = None, None
    ids = out["input_ids"][0]
    if ids.numel() > max_prompt_tokens:
        raise BadSample("prompt_too_long", f"{ids.numel()} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    return EncodedPrompt(sample.index, ids, pixel_values, grid, list(sample.images), sample.answer)


def encode_response(tokenizer, text: str, eos_token: str = "<|im_end|>") -> torch.Tensor:
    """Token ids of an assistant turn as the engine would generate it (ending in the end-of-turn token)."""
    return torch.tensor(tokenizer.encode(text + eos_token, add_special_tokens=False), dtype=torch.long)


def sft_target(task: str, answer: str) -> str:
    return SFT_TARGETS.get(task, SFT_TARGETS["generic"]).format(answer=answer)
