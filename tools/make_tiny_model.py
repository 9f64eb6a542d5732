"""Build tiny offline VLM checkpoints laid out like hub checkpoints.

    python tools/make_tiny_model.py --family qwen2_5_vl --size tiny --out /tmp/tiny-qwen2_5_vl
    python tools/make_tiny_model.py --family qwen2_vl --size demo --out ckpt/demo --seed 3
    python tools/make_tiny_model.py --family gemma3 --size tiny --out /tmp/tiny-gemma3

Families: qwen2_vl, qwen2_5_vl, qwen3_vl, llava (a CLIP tower over a Qwen2 decoder),
idefics3 (SmolVLM: a SigLIP-style tower over a Llama decoder) and gemma3. Every family's
chat template lays turns out as ChatML does (`<|im_start|>` + role, a newline, the message),
but ends each turn with the family's own end-of-turn token (`<|im_end|>` for Qwen, `</s>` for
LLaVA, `<end_of_utterance>` for SmolVLM, `<end_of_turn>` for Gemma3), so stopping and SFT
targets follow the family as they do with real checkpoints; the tokenizer's eos and
generation_config.json stay Qwen's (`<|im_end|>`, `<|endoftext|>`) for every family. The image
part of the template and its special tokens are the family's own
(`<|vision_start|><|image_pad|><|vision_end|>`, `<image>`, `<start_of_image>`), expanded by
`data.processing` exactly as the family's processor does.
The Qwen-specific details below (hub weight names, mrope, window attention) apply to the
Qwen families; LLaVA and Gemma3 save in their pre-4.52 hub layout (`language_model.*`,
`vision_tower.*`, `multi_modal_projector.*`), Idefics3 in its only one (`model.text_model.*`,
`model.vision_model.*`, `model.connector.*`). Fixed-size families take square images of
twice the size's minimum side (56 pixels tiny, 112 demo); Idefics3 tiles images up to two
tiles a side plus a global tile; the tiny Gemma3 pools each image to 4 soft tokens and
keeps lm_head untied.

or, from Python, `make_tiny_model(out, family="qwen2_5_vl", size="tiny", seed=0)`.

The folder holds what a hub checkpoint of the family holds, written by transformers'
own classes; nothing is downloaded:

- `config.json`: the family's config class (model_type qwen2_vl / qwen2_5_vl), token
  ids taken from the tokenizer below;
- `generation_config.json`: token ids only (eos = <|im_end|>, <|endoftext|>; pad), no
  sampling defaults, so an engine that reads it does not change temperature or penalties;
- `model.safetensors`: random weights from `save_pretrained`, which in transformers 5
  names them as the hub checkpoints do (`model.embed_tokens.*`, `model.layers.*`,
  `model.norm.*`, `visual.*`, `lm_head.*`); loaded, they become `model.language_model.*`,
  `model.visual.*`, `lm_head.*`, and `--weight-names current` writes those names instead;
- `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`: the tokenizer below
  and a chat template that behaves like the Qwen2-VL one;
- `preprocessor_config.json` (flat, as on the hub) and `processor_config.json` (nested,
  as transformers 5 writes it): the family's image processor and processor class.

The tokenizer is a byte-level BPE trained here with `tokenizers` on the corpus of
`tools/corpus.py`, with the Qwen2 pre-tokenizer (the one the family's tokenizer class
rebuilds at load time) and the family's special tokens added right after the BPE vocab.
BPE vocab: 1500 (tiny) / 3000 (demo) entries, 256 of them the byte alphabet; the
model's `vocab_size` is the tokenizer length rounded up to a multiple of 64, so, as in
the real checkpoints, the embedding has a few rows no token maps to. The corpus, and so
the tokenizer, does not depend on `seed`: checkpoints built with different seeds share
token ids and differ only in their weights. Every string round-trips exactly once
NFC-normalized: like the family's own tokenizer, this one applies NFC first.

Sizes (weights in float32, untied embeddings):

| size | text (hidden/layers/heads/kv/mlp, mrope) | vision (hidden/depth/heads) | pixels per image (min..max) |
| --- | --- | --- | --- |
| tiny | 64 / 2 / 4 / 2 / 128, [2, 3, 3] | 32 / 2 / 2 | 28*28*1 .. 28*28*16 (1..16 image tokens) |
| demo | 256 / 4 / 4 / 2 / 768, [8, 12, 12] | 128 / 4 / 4 | 28*28*4 .. 28*28*64 (4..64 image tokens) |

Qwen2.5-VL's vision tower alternates window and full attention: tiny uses a 56-pixel
window (2x2 merged tokens) with block 1 full, demo the family's 112-pixel window with
blocks 1 and 3 full, so images at the size's max pixels span several windows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (python tools/make_tiny_model.py): make the repo importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from tools.corpus import generate_corpus  # noqa: E402

# The Qwen2-VL family's special tokens, in the order the hub tokenizers number them.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5-VL's tokenizer adds these after the vision tokens; the tool-call tags are
# added tokens but not special (they survive skip_special_tokens), as on the hub.
QWEN2_5_EXTRA_TOKENS = (
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Behaves like the Qwen2-VL chat template: a default system turn, ChatML turns (each ended by
# the family's end-of-turn token, `<|im_end|>` for Qwen), one vision placeholder per
# image/video part (numbered when add_vision_id is set), and the assistant header for
# add_generation_prompt. Every tag strips the whitespace around it, so all output comes from
# the quoted strings and the template's layout is free.
CHAT_TEMPLATE = """\
{%- set seen = namespace(images=0, videos=0) -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM_PROMPT + """@END_OF_TURN@\\n' -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
                {%- set seen.images = seen.images + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Picture ' + seen.images | string + ': ' -}}
                {%- endif -%}
                {{- '""" + "@IMAGE_PART@" + """' -}}
            {%- elif part['type'] == 'video' or 'video' in part -%}
                {%- set seen.videos = seen.videos + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Video ' + seen.videos | string + ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '@END_OF_TURN@\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""



def chat_template(family: FamilySpec) -> str:
    """The ChatML-laid-out template with the family's image part and end-of-turn token."""
    return CHAT_TEMPLATE.replace("@IMAGE_PART@", family.image_part).replace("@END_OF_TURN@", family.end_of_turn)


# OpenAI CLIP normalization, which both families' image processors use.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
VOCAB_MULTIPLE = 64
WEIGHT_NAMES = ("hub", "current")


@dataclass(frozen=True)
class FamilySpec:
    """What differs between the supported families."""

    config_class: str
    model_class: str
    processor_class: str
    extra_tokens: tuple[tuple[str, bool], ...]
    # What the chat template writes for one image part (the processor expands it).
    image_part: str = "<|vision_start|><|image_pad|><|vision_end|>"
    patch_size: int = PATCH_SIZE
    # What the chat template writes after every message (the family's real end-of-turn token).
    end_of_turn: str = "<|im_end|>"
    # Tokenizer attributes the family's processor reads by name (saved in tokenizer_config.json).
    named_tokens: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SizeSpec:
    """Shapes and limits of one checkpoint size."""

    bpe_vocab: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    max_positions: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_mlp_ratio: int  # Qwen2-VL's vision MLP width, as a multiple of vision_hidden
    vision_intermediate: int  # Qwen2.5-VL's gated vision MLP width
    window_size: int  # Qwen2.5-VL window attention, in pixels
    fullatt_blocks: tuple[int, ...]  # Qwen2.5-VL blocks with full attention
    min_pixels: int
    max_pixels: int
    vocab_size: int = 0  # model vocab; 0 = the tokenizer length rounded up to VOCAB_MULTIPLE


FAMILIES = {
    "qwen2_vl": FamilySpec(
        config_class="Qwen2VLConfig",
        model_class="Qwen2VLForConditionalGeneration",
        processor_class="Qwen2VLProcessor",
        extra_tokens=(),
    ),
    "qwen2_5_vl": FamilySpec(
        config_class="Qwen2_5_VLConfig",
        model_class="Qwen2_5_VLForConditionalGeneration",
        processor_class="Qwen2_5_VLProcessor",
        extra_tokens=QWEN2_5_EXTRA_TOKENS,
    ),
    # Qwen3-VL: 16-pixel patches (32-pixel grid), learned position embeddings interpolated to
    # the image's grid, DeepStack features from a few vision blocks, interleaved m-rope.
    "qwen3_vl": FamilySpec(
        config_class="Qwen3VLConfig",
        model_class="Qwen3VLForConditionalGeneration",
        processor_class="Qwen3VLProcessor",
        extra_tokens=QWEN2_5_EXTRA_TOKENS + (("<think>", False), ("</think>", False)),
        patch_size=16,
    ),
    # LLaVA (1.5 layout) over a Qwen2 decoder: a CLIP tower at one square size, the second-to-last
    # layer's patch features (CLS dropped), a 2-layer MLP projector; one <image> token per patch.
    "llava": FamilySpec(
        config_class="LlavaConfig",
        model_class="LlavaForConditionalGeneration",
        processor_class="LlavaProcessor",
        extra_tokens=(("<image>", True), ("</s>", True)),
        image_part="<image>",
        end_of_turn="</s>",
    ),
    # SmolVLM (Idefics3) over a Llama decoder: images tiled into squares of the tower's size plus
    # a global tile, pixel-shuffled by 2x2, framed by <fake_token_around_image>/<row_r_col_c>/<global-img>.
    "idefics3": FamilySpec(
        config_class="Idefics3Config",
        model_class="Idefics3ForConditionalGeneration",
        processor_class="Idefics3Processor",
        extra_tokens=(("<fake_token_around_image>", True), ("<image>", True), ("<global-img>", True),
                      ("<end_of_utterance>", True))
        + tuple((f"<row_{r}_col_{c}>", True) for r in range(1, 7) for c in range(1, 7)),
        image_part="<image>",
        end_of_turn="<end_of_utterance>",
    ),
    # Gemma3 (its 4B+ vision models): a SigLIP tower at one square size, average-pooled to a
    # fixed number of soft tokens, bidirectional attention inside each image, sliding-window
    # and global decoder layers. The tiny one keeps lm_head untied (Gemma3 ties it).
    "gemma3": FamilySpec(
        config_class="Gemma3Config",
        model_class="Gemma3ForConditionalGeneration",
        processor_class="Gemma3Processor",
        # Runs of 1-4 newlines are single tokens, as in Gemma3's own vocabulary: vLLM's Gemma3
        # processor looks "\n" … "\n\n\n\n" up by those strings to merge them around images.
        extra_tokens=(("<start_of_image>", True), ("<image_soft_token>", True), ("<end_of_image>", True),
                      ("<end_of_turn>", True)) + tuple(("\n" * k, False) for k in (1, 2, 3, 4)),
        image_part="<start_of_image>",
        end_of_turn="<end_of_turn>",
        # Gemma3Processor (transformers, and vLLM's processor through it) reads these, as Gemma3's
        # own tokenizer_config.json declares them.
        named_tokens=(("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                      ("image_token", "<image_soft_token>")),
    ),
}

GEMMA3_TOKENS = 4  # soft tokens per image of the tiny Gemma3 (the 4B model: 256), a square number

def processor_fields(family_name: str, size: SizeSpec) -> dict:
    """What the family's processor class reads from processor_config.json besides the image processor."""
    if family_name == "gemma3":
        return {"image_seq_length": GEMMA3_TOKENS}
    if family_name == "idefics3":  # tokens per tile: (tile / patch)² / scale_factor², scale_factor 2
        return {"image_seq_len": (fixed_image_side(size) // PATCH_SIZE) ** 2 // 4}
    if family_name == "llava":
        return {"patch_size": PATCH_SIZE, "vision_feature_select_strategy": "default",
                "num_additional_image_tokens": 1, "image_token": "<image>"}
    return {}

SIZES = {
    "tiny": SizeSpec(
        bpe_vocab=1500, text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2,
        text_intermediate=128, mrope_section=(2, 3, 3), max_positions=8192,
        vision_hidden=32, vision_depth=2, vision_heads=2, vision_mlp_ratio=4,
        vision_intermediate=64, window_size=56, fullatt_blocks=(1,),
        min_pixels=28 * 28 * 1, max_pixels=28 * 28 * 16,
    ),
    "demo": SizeSpec(
        bpe_vocab=3000, text_hidden=256, text_layers=4, text_heads=4, text_kv_heads=2,
        text_intermediate=768, mrope_section=(8, 12, 12), max_positions=8192,
        vision_hidden=128, vision_depth=4, vision_heads=4, vision_mlp_ratio=4,
        vision_intermediate=384, window_size=112, fullatt_blocks=(1, 3),
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
    ),
    # The shapes of Qwen2.5-VL-3B-Instruct (3.75B parameters, 151936-row embedding) with a
    # small local tokenizer: for GPU benchmarks and fidelity checks, not for CPU tests.
    "3b": SizeSpec(
        bpe_vocab=3000, text_hidden=2048, text_layers=36, text_heads=16, text_kv_heads=2,
        text_intermediate=11008, mrope_section=(16, 24, 24), max_positions=128000,
        vision_hidden=1280, vision_depth=32, vision_heads=16, vision_mlp_ratio=4,
        vision_intermediate=3420, window_size=112, fullatt_blocks=(7, 15, 23, 31),
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, vocab_size=151936,
    ),
}


def _lookup(table: dict, key: str, what: str):
    """table[key], or a ValueError naming the bad key and the valid ones."""
    if key not in table:
        raise ValueError(f"make_tiny_model: unknown {what} {key!r}; expected one of {sorted(table)}")
    return table[key]


def _check_size(size: SizeSpec) -> None:
    """Fail early on shapes the family's model code would reject or mis-handle."""
    head_dim, rem = divmod(size.text_hidden, size.text_heads)
    if rem or size.text_heads % size.text_kv_heads:
        raise ValueError(f"make_tiny_model: text heads {size.text_heads}/{size.text_kv_heads} do not divide hidden {size.text_hidden}")
    if sum(size.mrope_section) * 2 != head_dim:
        raise ValueError(f"make_tiny_model: mrope_section {size.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    if size.window_size % (PATCH_SIZE * MERGE_SIZE):
        raise ValueError(f"make_tiny_model: window_size {size.window_size} must be a multiple of {PATCH_SIZE * MERGE_SIZE}")
    if any(not 0 <= i < size.vision_depth for i in size.fullatt_blocks):
        raise ValueError(f"make_tiny_model: fullatt_blocks {size.fullatt_blocks} must lie in [0, {size.vision_depth})")


def train_bpe(lines: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the Qwen2 tokenizer's normalizer and pre-tokenizer.

    The pipeline is taken from a fresh `Qwen2Tokenizer`, because that class rebuilds
    exactly this pipeline around the saved vocab and merges when the checkpoint is
    loaded: training with anything else would give merges the loader never applies.
    """
    reference = transformers.Qwen2Tokenizer().backend_tokenizer
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = reference.normalizer
    tokenizer.pre_tokenizer = reference.pre_tokenizer
    tokenizer.decoder = reference.decoder
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"train_bpe: the corpus yielded {tokenizer.get_vocab_size()} tokens, not {vocab_size}; "
            "grow tools/corpus.py or lower the size's bpe_vocab"
        )
    return tokenizer


def build_tokenizer(family: FamilySpec, size: SizeSpec):
    """The family's tokenizer class over a locally trained BPE and the family's added tokens."""
    backend = train_bpe(generate_corpus(), size.bpe_vocab)
    added = [(token, True) for token in SPECIAL_TOKENS] + list(family.extra_tokens)
    # One at a time so ids follow the listed order whatever the special flag.
    for content, special in added:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    tokenizer = transformers.Qwen2Tokenizer(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=size.max_positions,
        **({"extra_special_tokens": dict(family.named_tokens)} if family.named_tokens else {}),
    )
    tokenizer.chat_template = chat_template(family)
    ids = [tokenizer.convert_tokens_to_ids(content) for content, _ in added]
    if ids != list(range(size.bpe_vocab, size.bpe_vocab + len(added))):
        raise RuntimeError(f"build_tokenizer: added tokens got ids {ids}, expected them right after the BPE vocab")
    return tokenizer


def fixed_image_side(size: SizeSpec) -> int:
    """The square input side of fixed-size families: twice the side of the size's minimum image."""
    return int(round((4 * size.min_pixels) ** 0.5 / PATCH_SIZE)) * PATCH_SIZE


def build_image_processor(size: SizeSpec, family_name: str = "qwen2_5_vl"):
    """The family's image processor with the size's pixel limits.

    The PIL flavour is used where it exists because it needs no torchvision; it saves
    under the family's canonical name, so loaders pick whichever flavour they have.
    Qwen3-VL's grid is 32 pixels, not 28: its limits are the size's, scaled by (32/28)².
    """
    family = FAMILIES[family_name]
    if family_name == "gemma3":
        side = fixed_image_side(size)
        cls = getattr(transformers, "Gemma3ImageProcessorPil", None) or transformers.Gemma3ImageProcessor
        return cls(size={"height": side, "width": side}, do_pan_and_scan=False,
                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    if family_name == "idefics3":
        # Images up to two tiles a side: a 2x2 split plus the global tile at most.
        tile = fixed_image_side(size)
        cls = getattr(transformers, "Idefics3ImageProcessorPil", None) or transformers.Idefics3ImageProcessor
        return cls(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}, do_image_splitting=True,
                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    if family_name == "llava":
        side = fixed_image_side(size)
        cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
        return cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                   image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    if family_name == "qwen3_vl":
        scale = (family.patch_size * MERGE_SIZE) ** 2 / (PATCH_SIZE * MERGE_SIZE) ** 2
        return cls(min_pixels=int(size.min_pixels * scale), max_pixels=int(size.max_pixels * scale),
                   patch_size=family.patch_size, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return cls(
        min_pixels=size.min_pixels,
        max_pixels=size.max_pixels,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )


def _vision_config(family_name: str, size: SizeSpec) -> dict:
    """Vision sub-config in the field names of the family's vision config class."""
    common = dict(
        depth=size.vision_depth,
        num_heads=size.vision_heads,
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    if family_name == "qwen2_vl":
        # Qwen2-VL: embed_dim is the tower's width, hidden_size the merger's output.
        return dict(common, embed_dim=size.vision_hidden, hidden_size=size.text_hidden,
                    mlp_ratio=size.vision_mlp_ratio)
    if family_name == "gemma3":
        return dict(model_type="siglip_vision_model", hidden_size=size.vision_hidden,
                    intermediate_size=size.vision_intermediate, num_hidden_layers=size.vision_depth,
                    num_attention_heads=size.vision_heads, image_size=fixed_image_side(size), patch_size=PATCH_SIZE,
                    vision_use_head=False)
    if family_name == "idefics3":
        return dict(hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                    num_hidden_layers=size.vision_depth, num_attention_heads=size.vision_heads,
                    image_size=fixed_image_side(size), patch_size=PATCH_SIZE)
    if family_name == "llava":
        return dict(model_type="clip_vision_model", hidden_size=size.vision_hidden,
                    intermediate_size=size.vision_intermediate, num_hidden_layers=size.vision_depth,
                    num_attention_heads=size.vision_heads, image_size=fixed_image_side(size), patch_size=PATCH_SIZE,
                    projection_dim=size.text_hidden, hidden_act="quick_gelu")
    if family_name == "qwen3_vl":
        # DeepStack levels at 1/4, 1/2 and 3/4 of the depth (the 8B model: blocks 8, 16, 24 of 27),
        # a learned 8x8 position table interpolated to each image's grid.
        depth = size.vision_depth
        deepstack = sorted({min(depth - 1, depth * k // 4) for k in (1, 2, 3)})
        return dict(common, patch_size=FAMILIES[family_name].patch_size, hidden_size=size.vision_hidden,
                    intermediate_size=size.vision_intermediate, out_hidden_size=size.text_hidden,
                    num_position_embeddings=64, deepstack_visual_indexes=deepstack)
    return dict(
        common,
        hidden_size=size.vision_hidden,
        intermediate_size=size.vision_intermediate,
        out_hidden_size=size.text_hidden,
        window_size=size.window_size,
        fullatt_block_indexes=list(size.fullatt_blocks),
        tokens_per_second=2,
    )


def _rope_parameters(family_name: str, size: SizeSpec) -> dict:
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(size.mrope_section)}
    if family_name == "qwen3_vl":
        rope.update(rope_theta=5000000.0, mrope_interleaved=True)
    return rope


def build_config(family_name: str, size: SizeSpec, tokenizer):
    """The family's config class with the size's shapes and the tokenizer's token ids."""
    family = FAMILIES[family_name]
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    vocab_size = size.vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < len(tokenizer):
        raise ValueError(f"make_tiny_model: vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate,
        num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_kv_heads,
        max_position_embeddings=size.max_positions,
        max_window_layers=size.text_layers,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters=_rope_parameters(family_name, size),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    if family_name == "qwen3_vl":
        text_config["head_dim"] = size.text_hidden // size.text_heads
        for key in ("max_window_layers", "use_sliding_window"):
            text_config.pop(key)
    config_class = getattr(transformers, family.config_class)
    if family_name == "gemma3":
        head_dim = size.text_hidden // size.text_heads
        text = dict(model_type="gemma3_text", vocab_size=text_config["vocab_size"], hidden_size=size.text_hidden,
                    intermediate_size=size.text_intermediate, num_hidden_layers=size.text_layers,
                    num_attention_heads=size.text_heads, num_key_value_heads=size.text_kv_heads, head_dim=head_dim,
                    query_pre_attn_scalar=head_dim, max_position_embeddings=size.max_positions, rms_norm_eps=1e-6,
                    sliding_window=16, tie_word_embeddings=False,
                    layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(size.text_layers)],
                    bos_token_id=text_config["bos_token_id"], eos_token_id=text_config["eos_token_id"],
                    pad_token_id=text_config["bos_token_id"])
        return config_class(
            text_config=text, vision_config=_vision_config(family_name, size), mm_tokens_per_image=GEMMA3_TOKENS,
            boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
            eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
            image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"), tie_word_embeddings=False,
            architectures=[family.model_class],
        )
    if family_name == "idefics3":
        text_config = {k: v for k, v in text_config.items() if k not in ("max_window_layers", "use_sliding_window")}
        text_config.update(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        return config_class(
            text_config=text_config, vision_config=_vision_config(family_name, size),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2, tie_word_embeddings=False,
            architectures=[family.model_class],
        )
    if family_name == "llava":
        text_config = dict(text_config, model_type="qwen2")
        text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        return config_class(
            text_config=text_config, vision_config=_vision_config(family_name, size),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            image_seq_length=(fixed_image_side(size) // PATCH_SIZE) ** 2, vision_feature_layer=-2,
            vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
            architectures=[family.model_class],
        )
    return config_class(
        text_config=text_config,
        vision_config=_vision_config(family_name, size),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=[family.model_class],
    )


def _draw_zero_matrices(model, std: float = 0.02) -> None:
    """Draw every weight matrix transformers initializes to zeros (Gemma3's image projection).

    A zero projection makes every image feature zero: the decoder would never see the image,
    and no test comparing two implementations of the vision path could fail.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, std)


def build_model(family_name: str, config, tokenizer, seed: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32):
    """A randomly initialized model of the family; the same seed gives the same weights
    (on the same device: CUDA draws other numbers than the CPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[family_name].model_class)(config)
        _draw_zero_matrices(model)
        model = model.to(dtype)
    eot, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot
    )
    return model.eval()


def _write_json(path: Path, data: dict) -> None:
    """JSON as transformers writes its configs: indented, sorted keys, trailing newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_processor_files(out: Path, tokenizer, image_processor, processor_class: str,
                         template: str = chat_template(FAMILIES["qwen2_vl"]),
                         processor_fields: dict | None = None) -> None:
    """Write the tokenizer, chat template, image processor and processor config.

    This writes what `ProcessorMixin.save_pretrained` writes in transformers 5, without
    constructing the processor: its constructor needs torchvision (for the video
    processor) even when no video is ever processed. The nested `processor_config.json`
    leaves the video processor out, so loaders fall back to `preprocessor_config.json`
    for it, as they do for hub checkpoints.
    """
    tokenizer._set_processor_class(processor_class)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    flat = json.loads((out / "preprocessor_config.json").read_text(encoding="utf-8"))
    flat["processor_class"] = processor_class
    _write_json(out / "preprocessor_config.json", flat)
    _write_json(out / "processor_config.json", {"image_processor": image_processor.to_dict(),
                                                 "processor_class": processor_class, **(processor_fields or {})})
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")



@contextlib.contextmanager
def _quiet_progress_bars():
    """Hide transformers' progress bars for the block, restoring the caller's setting after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_weights(model, out: Path, weight_names: str) -> None:
    """Write config.json, generation_config.json and model.safetensors with save_pretrained.

    "hub" keeps save_pretrained's default, which writes the names the family's hub
    checkpoints use (`model.layers.*`, `model.embed_tokens.*`, `visual.*`, `lm_head.*`);
    "current" writes the names of the loaded model's modules (`model.language_model.*`,
    `model.visual.*`, `lm_head.*`). transformers loads both.
    """
    kwargs = {} if weight_names == "hub" else {"save_original_format": False}
    with _quiet_progress_bars():
        model.save_pretrained(out, safe_serialization=True, **kwargs)


def _summary(out: Path, family_name: str, size_name: str, model, tokenizer, seconds: float) -> str:
    """One line describing what was built."""
    total = sum(p.numel() for p in model.parameters())
    tower = getattr(model.model, "visual", None) or getattr(model.model, "vision_tower", None)
    tower = tower if tower is not None else model.model.vision_model
    vision = sum(p.numel() for p in tower.parameters())
    size = SIZES[size_name] if isinstance(size_name, str) else size_name
    size_name = size_name if isinstance(size_name, str) else "custom"
    return (
        f"make_tiny_model: {family_name}/{size_name} -> {out} | params {total / 1e6:.2f}M "
        f"(vision {vision / 1e6:.2f}M) | tokenizer {len(tokenizer)} tokens, model vocab "
        f"{model.config.text_config.vocab_size} | text {size.text_hidden}x{size.text_layers}, "
        f"vision {size.vision_hidden}x{size.vision_depth} | pixels {size.min_pixels}..{size.max_pixels} "
        f"| {seconds:.1f}s"
    )


def make_tiny_model(
    out: str | os.PathLike,
    family: str = "qwen2_5_vl",
    size: str | SizeSpec = "tiny",
    seed: int = 0,
    overwrite: bool = False,
    verbose: bool = False,
    weight_names: str = "hub",
    device: str = "cpu",
    dtype: str = "float32",
) -> Path:
    """Build a random-weight checkpoint of `family` at `size` into the folder `out`.

    `seed` draws the weights (the tokenizer does not depend on it); `weight_names`
    picks the tensor names in model.safetensors (see `_save_weights`). The folder is
    written under a temporary name and renamed when complete, so it never exists
    half-written. An existing `out` is an error unless `overwrite`. With `verbose`,
    prints a one-line summary. `size` is a name in SIZES or a SizeSpec; `device` and
    `dtype` ("float32" or "bfloat16") are where the weights are drawn and how they are
    saved (the 3b size is best drawn on a GPU and saved in bfloat16). Returns the folder.
    """
    family_spec = _lookup(FAMILIES, family, "family")
    size_spec = size if isinstance(size, SizeSpec) else _lookup(SIZES, size, "size")
    torch_dtype = _lookup({"float32": torch.float32, "bfloat16": torch.bfloat16}, dtype, "dtype")
    if weight_names not in WEIGHT_NAMES:
        raise ValueError(f"make_tiny_model: weight_names must be one of {WEIGHT_NAMES}, got {weight_names!r}")
    _check_size(size_spec)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"make_tiny_model: {out} already exists; remove it or pass overwrite=True (--overwrite)")
    start = time.perf_counter()
    tokenizer = build_tokenizer(family_spec, size_spec)
    config = build_config(family, size_spec, tokenizer)
    model = build_model(family, config, tokenizer, seed, device=device, dtype=torch_dtype)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _save_weights(model, staging, weight_names)
        save_processor_files(staging, tokenizer, build_image_processor(size_spec, family), family_spec.processor_class,
                             chat_template(family_spec), processor_fields(family, size_spec))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if verbose:
        print(_summary(out, family, size, model, tokenizer, time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description="Build a tiny offline Qwen2-VL-family checkpoint.")
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--weight-names", choices=WEIGHT_NAMES, default="hub",
                        help="tensor names in model.safetensors: the hub checkpoints' (default) or the modules' own")
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster for --size 3b)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the saved weights")
    args = parser.parse_args(argv)
    try:
        make_tiny_model(args.out, family=args.family, size=args.size, seed=args.seed,
                        overwrite=args.overwrite, verbose=True, weight_names=args.weight_names,
                        device=args.device, dtype=args.dtype)
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
