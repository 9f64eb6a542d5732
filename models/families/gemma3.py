"""Gemma3 (its 4B+ vision models): a SigLIP tower at one square size, average-pooled to a fixed
number of soft tokens per image, bidirectional attention inside each image, sliding-window and
global decoder layers.

The chat template writes `<start_of_image>` per image; the processor frames the soft tokens with
"\n\n" on both sides, which Gemma's tokenizer merges with the text's own newlines. LLaVA's
weight layout and vLLM names (`models.families.llava`); vLLM 0.26 runs it through FlexAttention
(bidirectional image blocks). The tiny one keeps lm_head untied (Gemma3 ties it).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import transformers

from data.processing import size_field
from models.families.llava import (
    ADD_VISION_MODEL, LLAVA_PREFIXES, LLAVA_STACKING, FixedSizeImages, LlavaAdapter,
)
from models.families.tiny import PATCH_SIZE, SizeSpec, TinySpec, fixed_image_side, text_config, token_ids
from models.family import Family, VLLMNames, register, replace_targets

GEMMA3_TOKENS = 4  # soft tokens per image of the tiny Gemma3 (the 4B model: 256), a square number


def image_tokens(grid_row) -> int:
    """Soft tokens of one image of grid (1, k, k): k²."""
    return int(torch.as_tensor(grid_row).prod())


class Gemma3Images(FixedSizeImages):
    """Gemma3: a fixed square image of `image_seq_length` soft tokens, framed as the Gemma3Processor does.

    The chat template writes `<start_of_image>` per image; it becomes
    "\\n\\n<start_of_image>" + image_seq_length × `<image_soft_token>` + "<end_of_image>\\n\\n".
    image_grid_thw: (1, k, k) with k² = image_seq_length. Pan-and-scan crops are not used.
    """

    placeholder = "<start_of_image>"

    def __init__(self, image_processor, config: dict):
        size = image_processor.size
        self.image_processor = image_processor
        self.size = (int(size_field(size, "height")), int(size_field(size, "width")))
        self.tokens = int(config.get("image_seq_length", 256))
        self.side = int(round(self.tokens**0.5))

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = self.image_processor(images=images, do_pan_and_scan=False, return_tensors="pt")["pixel_values"]
        return pixels, torch.tensor([[1, self.side, self.side]] * len(images))

    def expansion(self, grid_row: torch.Tensor) -> str:
        return f"\n\n{self.placeholder}" + "<image_soft_token>" * image_tokens(grid_row) + "<end_of_image>\n\n"


@dataclass
class Gemma3Adapter(LlavaAdapter):
    """Gemma3: a SigLIP tower at one square size, average-pooled to `mm_tokens_per_image` soft tokens.

    Attention is causal except that the soft tokens of one image see each other both ways
    (in full and sliding-window layers alike); the model marks them with token_type_ids = 1,
    which this adapter derives from the image token. Positions are plain 1-D. Sequences pack
    (see `run_language_model` for the masks; the packed-vs-single test holds them to it).
    pixel_values: (images, 3, S, S); image_grid_thw: (1, k, k) with k² the tokens per image.
    Embeddings are scaled by sqrt(hidden) inside `embed_tokens` (not the image features), as in
    the model's own forward. The built-in engine runs one prompt at a time (sliding windows).
    """

    end_of_turn: str = "<end_of_turn>"
    tokens_per_image: int = 256
    batch_with_padding: bool = False  # sliding-window layers

    def image_token_count(self, grid_row: torch.Tensor) -> int:
        return image_tokens(grid_row)

    def rebuild_buffers(self, module, device) -> bool:
        if hasattr(module, "scalar_embed_scale"):  # Gemma3TextScaledWordEmbedding
            module._buffers["embed_scale"] = torch.tensor(float(module.scalar_embed_scale), device=device)
            return True
        return False

    def dummy_vision_inputs(self, device):
        side = int(round(self.tokens_per_image**0.5))
        return torch.zeros(1, 3, self.image_size, self.image_size, device=device), torch.tensor([[1, side, side]])

    def image_features(self, model, pixels, grid):
        out = model.model.get_image_features(pixels)
        return [out.pooler_output.flatten(0, 1)]

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        """The decoder under Gemma3's masks, built so that they also hold for a packed row.

        The model's own mask builder ORs the image blocks into the sliding-window mask as a mask
        function, which transformers evaluates on per-sequence positions when it detects a packed
        row: later sequences would then look up the first sequence's image blocks. Here the image
        blocks go in as `block_sequence_ids`, which are indexed by row position after packing is
        applied: full layers OR(causal, block), sliding layers OR(AND(causal, window), block),
        each AND same-sequence. That equals the model's AND(window, OR(causal, block)) whenever
        an image's tokens fit in the window (256 soft tokens against a 512/1024 window in the
        released models); an adapter whose images do not fit is built with packable=False and
        uses the model's own builder.
        """
        from transformers.masking_utils import create_causal_mask, sliding_window_overlay
        from transformers.models.gemma3.modeling_gemma3 import (
            create_masks_for_vision_model, get_block_sequence_ids_for_mask,
        )

        lm = self.language_model(model)
        positions = position_ids[0]
        kwargs = dict(config=lm.config, inputs_embeds=embeds, attention_mask=None, position_ids=positions,
                      **{_mask_cache_arg(create_causal_mask): None},
                      block_sequence_ids=get_block_sequence_ids_for_mask(image_mask.long(), device=embeds.device))
        if self.packable:
            masks = {"full_attention": create_causal_mask(**kwargs),
                     "sliding_attention": create_causal_mask(
                         **kwargs, and_mask_function=sliding_window_overlay(lm.config.sliding_window))}
        else:
            masks = create_masks_for_vision_model(**kwargs)
        out = lm(inputs_embeds=embeds, position_ids=positions, attention_mask=masks, use_cache=False)
        return out.last_hidden_state

    def engine_inputs(self, input_ids, positions, attention_mask, pixels, grid):
        kwargs = super().engine_inputs(input_ids, positions, attention_mask, pixels, grid)
        if pixels is not None:
            kwargs["token_type_ids"] = (input_ids == self.image_token_id).long()
        return kwargs

    # --- vLLM prompts ---------------------------------------------------------------------------
    # vLLM 0.26 (`Gemma3MultiModalProcessor`) targets `<start_of_image>` and inserts the tokenized
    # `Gemma3Processor.full_image_sequence`, "\n\n<start_of_image>" + soft tokens +
    # "<end_of_image>\n\n", i.e. [\n\n, boi, soft × k, eoi, \n\n]. Its `_apply_token_matches` then
    # merges newline tokens over the whole prompt, in this order: [\n, \n\n] → \n\n\n,
    # [\n\n, \n] → \n\n\n, [\n\n, \n\n] → \n\n\n\n. The trainer tokenized the same text in one
    # piece, so the newline token on each side of an image block holds the block's "\n\n" merged
    # with the text's own newlines; collapsing gives that text back its own part.
    def _newlines(self, vocab) -> list[int]:
        return [vocab["\n" * k] for k in (1, 2, 3, 4)]

    def vllm_target(self, vocab):
        return self.extra_banned_ids[0]  # boi

    def vllm_collapse(self, ids, vocab):
        """Each "\n\n" + boi + soft tokens + eoi + "\n\n" back to one `<start_of_image>`."""
        nl1, nl2, nl3, nl4 = self._newlines(vocab)
        boi, eoi = self.extra_banned_ids[:2]
        text_part = {nl2: [], nl3: [nl1], nl4: [nl2]}  # what is left of a newline token without "\n\n"
        block = [nl2, boi, *[self.image_token_id] * self.tokens_per_image, eoi, nl2]
        out: list[int] = []
        blocks: list[list[int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != boi:
                out.append(ids[i])
                i += 1
                continue
            end = i + 1 + self.tokens_per_image
            if ids[i + 1 : end] != [self.image_token_id] * self.tokens_per_image or end >= len(ids) \
                    or ids[end] != eoi:
                raise ValueError(f"vLLM prompt: <start_of_image> at {i} is not followed by "
                                 f"{self.tokens_per_image} soft tokens and <end_of_image>")
            before = out.pop() if out else None
            after = ids[end + 1] if end + 1 < len(ids) else None
            if before not in text_part or after not in text_part:
                raise ValueError(f"vLLM prompt: the image block at {i} is not framed by newline tokens "
                                 "holding Gemma3Processor's \"\\n\\n\" on both sides")
            out += text_part[before] + [boi] + text_part[after]
            blocks.append(block)
            i = end + 2
        return out, blocks

    def vllm_expand(self, ids, replacements, vocab):
        nl1, nl2, nl3, nl4 = self._newlines(vocab)
        out = replace_targets(ids, self.vllm_target(vocab), replacements)
        for pair, merged in (([nl1, nl2], nl3), ([nl2, nl1], nl3), ([nl2, nl2], nl4)):
            out = _merge_pairs(out, pair, merged)
        return out

    def vllm_processor_kwargs(self, min_pixels, max_pixels):
        # No pan-and-scan crops (the trainer's Gemma3Images calls the processor so): vLLM's
        # Gemma3ProcessingInfo.get_num_crops reads the same flag and returns 0 crops.
        return {"do_pan_and_scan": False}


@functools.cache
def _mask_cache_arg(create_causal_mask) -> str:
    """The cache argument's name: `past_key_values` up to transformers 5.17, `cache` in later releases."""
    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _merge_pairs(ids: list[int], pair: list[int], merged: int) -> list[int]:
    """Non-overlapping occurrences of the two-token `pair`, left to right, replaced by `merged`."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i : i + 2] == pair:
            out.append(merged)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _gemma3_adapter(config) -> Gemma3Adapter:
    vc = config.vision_config
    return Gemma3Adapter(
        name="gemma3",
        hf_architecture="Gemma3ForConditionalGeneration",
        image_token_id=getattr(config, "image_token_id", None) or config.image_token_index,
        extra_banned_ids=(config.boi_token_index, config.eoi_token_index),
        image_size=vc.image_size,
        patch_size=vc.patch_size,
        tokens_per_image=config.mm_tokens_per_image,
        packable=config.mm_tokens_per_image <= (config.text_config.sliding_window or 1 << 30),
    )


# --- tiny checkpoint ----------------------------------------------------------------------------
def _tiny_config(size: SizeSpec, tokenizer):
    head_dim = size.text_hidden // size.text_heads
    base = text_config(size, tokenizer)
    text = dict(model_type="gemma3_text", vocab_size=base["vocab_size"], hidden_size=size.text_hidden,
                intermediate_size=size.text_intermediate, num_hidden_layers=size.text_layers,
                num_attention_heads=size.text_heads, num_key_value_heads=size.text_kv_heads, head_dim=head_dim,
                query_pre_attn_scalar=head_dim, max_position_embeddings=size.max_positions, rms_norm_eps=1e-6,
                sliding_window=16, tie_word_embeddings=False,
                layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(size.text_layers)],
                bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"], pad_token_id=base["bos_token_id"])
    vision = dict(model_type="siglip_vision_model", hidden_size=size.vision_hidden,
                  intermediate_size=size.vision_intermediate, num_hidden_layers=size.vision_depth,
                  num_attention_heads=size.vision_heads, image_size=fixed_image_side(size), patch_size=PATCH_SIZE,
                  vision_use_head=False)
    boi, eoi, soft = token_ids(tokenizer, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS, boi_token_index=boi,
        eoi_token_index=eoi, image_token_index=soft, tie_word_embeddings=False,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def _tiny_image_processor(size: SizeSpec):
    side = fixed_image_side(size)
    cls = getattr(transformers, "Gemma3ImageProcessorPil", None) or transformers.Gemma3ImageProcessor
    return cls(size={"height": side, "width": side}, do_pan_and_scan=False,
               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


register(Family(
    model_type="gemma3",
    adapter=_gemma3_adapter,
    image_rules={"Gemma3Processor": Gemma3Images},
    vllm=VLLMNames(
        prefixes=LLAVA_PREFIXES, stacking_scopes=LLAVA_STACKING, vision_transformer="vision_tower.vision_model.",
        load_renames=ADD_VISION_MODEL, mm_prefix=True,
        unverified="measured on an H200 only with rollout.enforce_eager=true and gpu_memory_utilization=0.01 "
                   "(tiny model, token_mult_prob_error 1.0024 mean); the engine's KV cap for FlexAttention "
                   "(vllm_engine.flex_kv_cap_bytes) that lets the defaults start has not run on a GPU",
    ),
    tiny=TinySpec(
        model_class="Gemma3ForConditionalGeneration", processor_class="Gemma3Processor", config=_tiny_config,
        image_processor=_tiny_image_processor,
        # Runs of 1-4 newlines are single tokens, as in Gemma3's own vocabulary: vLLM's Gemma3
        # processor looks "\n" … "\n\n\n\n" up by those strings to merge them around images.
        extra_tokens=(("<start_of_image>", True), ("<image_soft_token>", True), ("<end_of_image>", True),
                      ("<end_of_turn>", True)) + tuple(("\n" * k, False) for k in (1, 2, 3, 4)),
        image_part="<start_of_image>", end_of_turn="<end_of_turn>",
        # Gemma3Processor (transformers, and vLLM's processor through it) reads these, as Gemma3's
        # own tokenizer_config.json declares them.
        named_tokens=(("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                      ("image_token", "<image_soft_token>")),
        processor_fields=lambda size: {"image_seq_length": GEMMA3_TOKENS},
    ),
))
