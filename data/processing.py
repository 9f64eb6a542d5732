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


class VLProcessor:
    """Tokenizer + image processor of a model folder, with placeholder expansion done here.

    Loading the pieces directly (not through AutoProcessor) keeps the image path free of the
    video processor, which needs torchvision. Expansion is the family rule: each image part's
    single `<|image_pad|>` becomes grid_t·grid_h·grid_w / merge² placeholders.
    """

    def __init__(self, model_path: str, trust_remote_code: bool = False):
        from transformers import AutoImageProcessor, AutoTokenizer

        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model folder not found: {model_path}")
        kw = dict(local_files_only=True, trust_remote_code=trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **kw)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, **kw)
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        self.image_pad = "<|image_pad|>"
        if self.tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer in {model_path} has no chat template")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def __call__(self, text: str, images: list) -> dict:
        pixel_values, grid = None, None
        if images:
            out = self.image_processor(images=images, do_resize=False, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
            parts = text.split(self.image_pad)
            if len(parts) - 1 != len(images):
                raise BadSample("image_count_mismatch", f"{len(parts) - 1} image parts for {len(images)} images")
            counts = [int(g.prod()) // self.merge_size**2 for g in grid]
            text = parts[0] + "".join(self.image_pad * n + rest for n, rest in zip(counts, parts[1:]))
        ids = torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        return {"input_ids": ids, "pixel_values": pixel_values, "image_grid_thw": grid}


def load_processor(model_path: str, trust_remote_code: bool = False) -> VLProcessor:
    return VLProcessor(model_path, trust_remote_code)


def encode_prompt(processor: VLProcessor, sample, task: str, max_prompt_tokens: int) -> EncodedPrompt:
    """Chat template + image processing on one sample; raises BadSample('prompt_too_long') instead of truncating."""
    text = processor.apply_chat_template(build_messages(sample, task))
    out = processor(text, list(sample.images))
    ids = out["input_ids"]
    if ids.numel() > max_prompt_tokens:
        raise BadSample("prompt_too_long", f"{ids.numel()} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    return EncodedPrompt(sample.index, ids, out["pixel_values"], out["image_grid_thw"], list(sample.images), sample.answer)


def encode_response(tokenizer, text: str, eos_token: str = "<|im_end|>") -> torch.Tensor:
    """Token ids of an assistant turn as the engine would generate it (ending in the end-of-turn token)."""
    return torch.tensor(tokenizer.encode(text + eos_token, add_special_tokens=False), dtype=torch.long)


def sft_target(task: str, answer: str) -> str:
    return SFT_TARGETS.get(task, SFT_TARGETS["generic"]).format(answer=answer)
