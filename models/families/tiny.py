"""What a family's tiny checkpoint is made of: the parts every family shares, and `TinySpec`.

tools/make_tiny_model.py trains the tokenizer, draws the weights and writes the folder; each
family module says, in its `TinySpec`, which transformers classes it uses, which tokens its
tokenizer adds, what its chat template writes for an image, and how its config and image
processor are built from a `SizeSpec`. Every family's tokenizer starts with Qwen2's special
tokens (its eos and pad are Qwen's) and adds the family's own after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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

# OpenAI CLIP normalization, which the Qwen-VL and LLaVA image processors use.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
VOCAB_MULTIPLE = 64


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
    # A released model's shapes (head_dim and mrope_section as that model has them, rotary over part
    # of each head): only the families named here build it. 0 / (): a generic size for every family.
    head_dim: int = 0
    families: tuple[str, ...] = ()


@dataclass(frozen=True)
class TinySpec:
    """How tools/make_tiny_model.py builds a tiny checkpoint of one family.

    `config(size, tokenizer)` returns the family's transformers config with the size's shapes and
    the tokenizer's ids; `image_processor(size)` its image processor; `processor_fields(size)`
    what the family's processor class reads from processor_config.json besides the image
    processor.
    """

    model_class: str
    processor_class: str
    config: Callable
    image_processor: Callable
    extra_tokens: tuple[tuple[str, bool], ...] = ()
    # What the chat template writes for one image part (the processor expands it).
    image_part: str = "<|vision_start|><|image_pad|><|vision_end|>"
    # What the chat template writes after every message (the family's real end-of-turn token).
    end_of_turn: str = "<|im_end|>"
    # Tokenizer attributes the family's processor reads by name (saved in tokenizer_config.json).
    named_tokens: tuple[tuple[str, str], ...] = ()
    processor_fields: Callable = field(default=lambda size: {})

    def chat_template(self) -> str:
        """The ChatML-laid-out template with the family's image part and end-of-turn token."""
        return CHAT_TEMPLATE.replace("@IMAGE_PART@", self.image_part).replace("@END_OF_TURN@", self.end_of_turn)


def fixed_image_side(size: SizeSpec) -> int:
    """The square input side of fixed-size families: twice the side of the size's minimum image."""
    return int(round((4 * size.min_pixels) ** 0.5 / PATCH_SIZE)) * PATCH_SIZE


def vocab_size(size: SizeSpec, tokenizer) -> int:
    """The model's vocab: the size's, or the tokenizer length rounded up (a few rows no token maps to)."""
    n = size.vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if n < len(tokenizer):
        raise ValueError(f"make_tiny_model: vocab_size {n} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    return n


def text_config(size: SizeSpec, tokenizer, **overrides) -> dict:
    """A decoder config dict with the size's shapes; bos/eos are Qwen's (every tiny tokenizer has them)."""
    out = dict(
        vocab_size=vocab_size(size, tokenizer),
        hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate,
        num_hidden_layers=size.text_layers,
        num_attention_heads=size.text_heads,
        num_key_value_heads=size.text_kv_heads,
        max_position_embeddings=size.max_positions,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    out.update(overrides)
    return out


def token_ids(tokenizer, *tokens: str) -> list[int]:
    """The ids of tokens the tokenizer must have."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"make_tiny_model: the tokenizer lacks one of {tokens}")
    return ids
