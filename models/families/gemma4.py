"""Gemma4 (transformers `gemma4`): a patch-sequence vision tower over a Gemma decoder with per-layer inputs.

Images keep their aspect ratio: the image processor resizes each one so that its patches fit
`max_soft_tokens · k²` (k: the tower's pooling kernel), sides multiples of `patch · k`, and emits
it as a padded patch sequence, (max_patches, 3·patch²) per image, with the (x, y) position of
every real patch and (-1, -1) for the padding. The tower attends over the real patches only,
pools k×k patches into one soft token and drops the padding; an image of (h, w) patches takes
h·w / k² soft tokens. Here `image_grid_thw` is (1, h, w) in patches, and the positions are
rebuilt from it (`patch_positions`), so the data path carries the same two tensors as every
family. The chat template writes `<|image|>` per image; it expands to `<|image>` + soft tokens +
`<image|>`.

The decoder differs from Gemma3's in what a packed row must reproduce:
- per-layer inputs (PLE): every decoder layer adds a gated projection of a per-layer embedding,
  built from the token ids (image soft tokens read as the pad token) and from the input
  embeddings after the image features are in. The policy hands `run_language_model` only
  embeddings, so the adapter keeps the ids of the row the decoder's embedding last read (a
  forward hook) and takes each call's slice of them in order, checking them against the
  embeddings it was given;
- bidirectional attention over each image's soft tokens (`use_bidirectional_attention: vision`)
  only in the sliding-window layers, as AND(window, OR(causal, same image)); the full-attention
  layers stay causal (`create_masks_for_vision_model`). The adapter builds both masks on row
  indices with each sequence of a packed row kept apart, which is transformers' rule exactly,
  whatever the image size against the window (tested);
- KV sharing (`num_kv_shared_layers`: the last layers reuse the keys and values of the last
  earlier layer of their type), larger heads in the full-attention layers and a proportional
  rope there: all inside transformers' layers, which see the same masks;
- the final logits are soft-capped (`final_logit_softcapping`, tanh(x / c)·c) in the head's dtype,
  op by op as transformers and vLLM's LogitsProcessor do; the softmax then takes them in fp32.

The built-in engine runs transformers' own forward (mm_token_type_ids mark the image tokens),
one prompt at a time (sliding-window layers). Gemma4's MoE variant (`enable_moe_block`) and
`use_bidirectional_attention: all` are refused. Video and audio inputs are not used.

vLLM: `Gemma4ForConditionalGeneration` (vLLM 0.26.0's gemma4_mm.py over gemma4.py). Its mapper's
prefixes apply in turn: `model.vision_tower` → `vision_tower` (transformers' own tower, built by
`AutoModel.from_config`, its nn.Linear swapped for vLLM's with the same names, so
`...q_proj.linear.weight`), `model.embed_vision` → `embed_vision` (only embedding_projection has a
weight), `model.language_model.` → `language_model.model.`, `lm_head.` → `language_model.lm_head.`.
Every decoder layer stacks q/k/v into qkv_proj and gate/up into gate_up_proj: the KV-sharing
layers too (the checkpoint has only their q_proj; vLLM never reads their k/v slots), and
attention_k_eq_v layers load k_proj into the v slot as well. Buffers (layer_scalar) load by name.
Its text model's load_weights reports each stacked tensor under its own name as well as the fused
one (`vllm_engine.load_into` keeps only real parameters). transformers 5.17 keeps `head_dim` per
layer and drops `global_head_dim` from the config, which vLLM 0.26 reads; `vllm_hf_config` (the
engine's hf_overrides) gives them back. Its processor targets `<|image|>` and inserts [`<|image>`,
soft tokens, `<image|>`], counting soft tokens from the image size and `max_soft_tokens` (else the
vision config's `default_output_length`), so prompts collapse to one `<|image|>` per image and the
engine passes `max_soft_tokens`. For the per-layer inputs vLLM reads image tokens as token 0, and
transformers as `pad_token_id` (0 in the released configs and the tiny one). Checked on CPU with
vLLM 0.26.0 and transformers 5.17 (tools/vllm_prompt_check.py, tools/vllm_load_check.py: prompt
ids, pixels, refit read back bitwise, image features equal). vLLM's V2 model runner (its default for
dense models) drops the bidirectional range of an image longer than the sliding window, so that image
attends causally there; where an image can be that long (`max_soft_tokens` above the window, as in
the tiny model) the engine runs on the V1 runner, whose Triton and FlashAttention 4 kernels cut the
range to the window as transformers does (`vllm_env`; docs/fidelity.md, Gemma4).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from PIL import Image
from torch import nn

from data.images import BadSample, to_rgb
from data.processing import ImageRule
from models.families.gemma3 import _mask_cache_arg
from models.families.tiny import SizeSpec, TinySpec, token_ids
from models.family import Family, FamilyAdapter, VLLMNames, register
from models.logits import fp32_head_logits

BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
VIDEO, BOA, EOA, AUDIO = "<|video|>", "<|audio>", "<audio|>", "<|audio|>"
END_OF_TURN = "<turn|>"
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # what Gemma4's image processor accepts


def image_tokens(grid_row, pooling: int) -> int:
    """Soft tokens of one image of (1, h, w) patches: h·w / k²."""
    return int(torch.as_tensor(grid_row).prod()) // (pooling * pooling)


def patch_positions(grid: torch.Tensor, patches: int) -> torch.Tensor:
    """(images, patches, 2) (x, y) of each image's patches in row-major order, (-1, -1) after them,
    as Gemma4's image processor writes `image_position_ids`."""
    out = torch.full((grid.shape[0], patches, 2), -1, dtype=torch.long)
    for i, (_, h, w) in enumerate(grid.tolist()):
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        out[i, : h * w, 0] = xs.flatten()
        out[i, : h * w, 1] = ys.flatten()
    return out


def target_size(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The (height, width) Gemma4's image processor resizes an image to
    (`get_aspect_ratio_preserving_size`): the largest sides that are multiples of patch·k and
    give at most `max_patches` patches at the image's aspect ratio."""
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    unit = pooling * patch
    th, tw = math.floor(factor * height / unit) * unit, math.floor(factor * width / unit) * unit
    if th == 0 and tw == 0:
        raise ValueError(f"Gemma4: a {height}x{width} image would be resized to 0x0")
    longest = (max_patches // pooling**2) * unit
    if th == 0:
        th, tw = unit, min(math.floor(width / height) * unit, longest)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * unit, longest), unit
    return th, tw


class Gemma4Images(ImageRule):
    """Gemma4: each image at a size the image processor keeps, a padded patch sequence, soft tokens framed.

    `prepare` resizes once to the size where the processor's own rule is a fixed point (applied to
    the original size it can land on a size it would resize again, for long thin images), so
    the processor, the trainer and vLLM all see those pixels. pixel_values: (images, max_patches,
    3·patch²); image_grid_thw: (1, h, w) in patches; `<|image|>` expands to `<|image>` + h·w/k²
    `<|image|>` + `<image|>`.
    """

    placeholder = IMAGE

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor
        self.patch = int(image_processor.patch_size)
        self.pooling = int(image_processor.pooling_kernel_size)
        self.max_patches = int(image_processor.max_soft_tokens) * self.pooling**2

    def size_for(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is brought to."""
        h, w = height, width
        for _ in range(32):
            th, tw = target_size(h, w, self.patch, self.max_patches, self.pooling)
            if (th, tw) == (h, w):
                return w, h
            h, w = th, tw
        raise BadSample("image_size", f"Gemma4: no stable size for a {width}x{height} image")

    def prepare(self, image):
        image = to_rgb(image)
        size = self.size_for(*image.size)
        return image if size == image.size else image.resize(size, resample=Image.Resampling.BICUBIC)

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.image_processor(images=images, return_tensors="pt")
        grid = torch.tensor([[1, img.size[1] // self.patch, img.size[0] // self.patch] for img in images])
        counts = [image_tokens(g, self.pooling) for g in grid]
        if counts != [int(n) for n in out["num_soft_tokens_per_image"]]:
            raise BadSample("image_size", f"Gemma4: images of {grid.tolist()} patches give "
                                          f"{out['num_soft_tokens_per_image']} soft tokens, expected {counts}")
        return out["pixel_values"], grid

    def expansion(self, grid_row: torch.Tensor) -> str:
        return BOI + IMAGE * image_tokens(grid_row, self.pooling) + EOI


class _SoftcappedHead(nn.Module):
    """lm_head followed by Gemma's final-logit soft cap, tanh(logits / cap) · cap, in the head's dtype.

    Divide, tanh, multiply, each rounded to the head's dtype: what transformers'
    Gemma4ForConditionalGeneration and vLLM's LogitsProcessor compute. In bf16 the cap taken in fp32
    instead differs from both by 0.02-0.04 nats per sampled token at logits of std 3-8 (a trained
    model's scale), 2e-4 at the tiny random model's.
    """

    def __init__(self, head: nn.Module, cap: float):
        super().__init__()
        self.head = head
        self.cap = cap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap

    def fp32_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """model.fp32_logits: the projection with fp32 output and the cap taken in fp32, as vLLM's
        LogitsProcessor does with head_dtype=float32; None where the inner head is not a plain linear one."""
        logits = fp32_head_logits(self.head, hidden)
        return None if logits is None else torch.tanh(logits / self.cap) * self.cap


@dataclass
class Gemma4Adapter(FamilyAdapter):
    """Gemma4: padded patch sequences through the tower, per-layer inputs, image blocks in the sliding layers.

    pixel_values: (images, max_patches, 3·patch²); image_grid_thw: (1, h, w) in patches. Positions
    are plain 1-D. See the module docstring for what `run_language_model` reproduces.
    """

    end_of_turn: str = END_OF_TURN
    batch_with_padding: bool = False  # sliding-window layers
    patch_size: int = 16
    pooling: int = 3
    max_soft_tokens: int = 280
    pad_token_id: int = 0
    bidirectional_images: bool = True
    sliding_window: int = 512
    softcap: float | None = None
    per_layer_inputs: bool = True
    kv_shared_layers: int = 0
    # Tokens the model reads as the pad token for the per-layer inputs (image, video, audio).
    multimodal_ids: tuple[int, ...] = ()
    _row: list = field(default_factory=lambda: [None, 0], repr=False)  # [ids of the last embedded row, cursor]
    _hooked: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)

    def image_token_count(self, grid_row: torch.Tensor) -> int:
        return image_tokens(grid_row, self.pooling)

    def check_pixels(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        super().check_pixels(pixels, grid)
        most = int(grid[:, 1:].prod(dim=1).max()) if grid.numel() else 0
        if pixels.dim() != 3 or pixels.shape[1] < most or pixels.shape[2] != 3 * self.patch_size**2:
            raise ValueError(f"Gemma4 pixel_values {tuple(pixels.shape)} is not (images, >= {most} patches, "
                             f"{3 * self.patch_size**2}) for image_grid_thw {grid.tolist()}")

    def dummy_vision_inputs(self, device):
        k = self.pooling
        return (torch.zeros(1, k * k, 3 * self.patch_size**2, device=device), torch.tensor([[1, k, k]]))

    def image_features(self, model, pixels, grid):
        positions = patch_positions(grid.cpu(), pixels.shape[1]).to(pixels.device)
        out = model.model.get_image_features(pixels, positions)
        return [torch.cat(list(out.pooler_output))]

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head if self.softcap is None else _SoftcappedHead(model.lm_head, self.softcap)

    def tp_plan(self) -> dict[str, str]:
        if self.kv_shared_layers:
            raise ValueError(f"parallel.tp > 1 is not supported for Gemma4 with KV-sharing layers (the last "
                             f"{self.kv_shared_layers} have no k_proj/v_proj for the plan to split); set parallel.tp=1")
        return super().tp_plan()

    def rebuild_buffers(self, module, device) -> bool:
        if hasattr(module, "scalar_embed_scale"):  # Gemma4TextScaledWordEmbedding (both embeddings)
            module._buffers["embed_scale"] = torch.tensor(float(module.scalar_embed_scale), device=device)
            return True
        return False

    # --- the packed decoder ----------------------------------------------------------------
    def embed_tokens(self, model: nn.Module) -> nn.Module:
        """The decoder's embedding; every call on it leaves its ids for `run_language_model`."""
        embedding = self.language_model(model).embed_tokens
        if embedding not in self._hooked:
            embedding.register_forward_hook(self._keep_ids)
            self._hooked.add(embedding)
        return embedding

    def _keep_ids(self, module, args, output):
        self._row[:] = [args[0], 0]

    def _row_ids(self, embedding: nn.Module, embeds: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        """The token ids behind `embeds`: the next slice of the row the embedding last read (the policy
        runs a row whole, or its sequences one after another)."""
        ids, at = self._row
        n = embeds.shape[1]
        if ids is None or ids.shape[0] != embeds.shape[0] or at + n > ids.shape[1]:
            raise RuntimeError("Gemma4: run_language_model needs the token ids of its embeddings; embed them with "
                               "adapter.embed_tokens(model)(input_ids) first")
        part = ids[:, at : at + n]
        self._row[1] = at + n if at + n < ids.shape[1] else 0
        with torch.no_grad():
            text = ~image_mask
            if not torch.equal(embeds[text], embedding.forward(part)[text]):  # forward: no hook
                raise RuntimeError("Gemma4: the embeddings given to run_language_model are not those of the "
                                   "token ids the decoder's embedding last read")
        return part

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        lm = self.language_model(model)
        ids = self._row_ids(lm.embed_tokens, embeds, image_mask)
        per_layer = None
        if self.per_layer_inputs:
            multimodal = torch.isin(ids, torch.tensor(self.multimodal_ids, device=ids.device))
            per_layer = lm.get_per_layer_inputs(ids.masked_fill(multimodal, self.pad_token_id), None)
        positions = position_ids[0]
        masks = self.attention_masks(lm.config, embeds, positions, image_mask)
        out = lm(inputs_embeds=embeds, per_layer_inputs=per_layer, position_ids=positions, attention_mask=masks,
                 use_cache=False)
        return out.last_hidden_state

    def attention_masks(self, config, embeds: torch.Tensor, positions: torch.Tensor, image_mask: torch.Tensor) -> dict:
        """Gemma4's masks over a packed row (B, L), on row indices, each sequence kept to itself.

        full_attention: causal. sliding_attention: AND(window, OR(causal, same image)), the image
        blocks only under `use_bidirectional_attention: vision`, as `create_masks_for_vision_model`
        builds them for one sequence. A sequence starts where its position is 0.
        """
        from transformers.masking_utils import and_masks, create_causal_mask, sliding_window_overlay

        sequence = torch.cumsum((positions == 0).long(), dim=-1)
        blocks = _image_blocks(image_mask) if self.bidirectional_images else None

        def same_sequence(batch_idx, head_idx, q_idx, kv_idx):
            return sequence[batch_idx, q_idx] == sequence[batch_idx, kv_idx]

        def same_image(batch_idx, head_idx, q_idx, kv_idx):
            return (blocks[batch_idx, q_idx] == blocks[batch_idx, kv_idx]) & (blocks[batch_idx, q_idx] >= 0)

        common = dict(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=None,
                      **{_mask_cache_arg(create_causal_mask): None})
        full = create_causal_mask(**common, and_mask_function=same_sequence)
        sliding = create_causal_mask(**common, or_mask_function=same_image if blocks is not None else None,
                                     and_mask_function=and_masks(sliding_window_overlay(self.sliding_window),
                                                                 same_sequence))
        return {"full_attention": full, "sliding_attention": sliding}

    def engine_inputs(self, input_ids, positions, attention_mask, pixels, grid):
        kwargs = super().engine_inputs(input_ids, positions, attention_mask, pixels, grid)
        if pixels is not None:
            kwargs["image_position_ids"] = patch_positions(grid.cpu(), pixels.shape[1]).to(pixels.device)
            kwargs["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        return kwargs

    # --- vLLM prompts ---------------------------------------------------------------------------
    # vLLM (`Gemma4MultiModalProcessor`) targets `<|image|>` and inserts [boi, soft × n, eoi].
    def vllm_collapse(self, ids, vocab):
        """Each `<|image>` + soft tokens + `<image|>` back to one `<|image|>`."""
        boi, eoi = self.extra_banned_ids[:2]
        out: list[int] = []
        blocks: list[list[int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != boi:
                if ids[i] == self.image_token_id:
                    raise ValueError(f"vLLM prompt: image token at {i} outside a <|image> ... <image|> block")
                out.append(ids[i])
                i += 1
                continue
            end = i + 1
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            if end == i + 1 or end >= len(ids) or ids[end] != eoi:
                raise ValueError(f"vLLM prompt: <|image> at {i} is not followed by soft tokens and <image|>")
            out.append(self.image_token_id)
            blocks.append(list(ids[i : end + 1]))
            i = end + 1
        return out, blocks

    def vllm_engine_kwargs(self) -> dict:
        # vLLM 0.26 reads the text config's head_dim and global_head_dim as plain attributes;
        # transformers 5.17 keeps them per layer (see `vllm_hf_config`).
        return {"hf_overrides": vllm_hf_config}

    def vllm_env(self) -> dict[str, str]:
        # vLLM 0.26's V2 model runner, its default for dense models, drops the bidirectional range of
        # an image longer than the sliding window (v1/worker/gpu/attn_utils.py compute_mm_prefix_ranges),
        # so such an image attends causally; the V1 runner keeps it and the attention kernel cuts it to
        # the window (gpu_model_runner.py, mm_prefix_clamp_sliding_window), transformers' rule.
        if self.bidirectional_images and self.max_soft_tokens > self.sliding_window:
            return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        return {}

    def vllm_processor_kwargs(self, min_pixels, max_pixels):
        # The trainer's images are at the processor's fixed point for this budget; vLLM counts soft
        # tokens from the image size and this value (without it, from default_output_length).
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:  # vLLM 0.26 refuses others per request
            raise ValueError(f"Gemma4 on vLLM: vision_config.default_output_length {self.max_soft_tokens} is not "
                             f"one of {SUPPORTED_SOFT_TOKENS}, the max_soft_tokens vLLM 0.26's processor takes")
        return {"max_soft_tokens": self.max_soft_tokens}


def vllm_hf_config(config):
    """vLLM 0.26's view of a transformers Gemma4 config (its `hf_overrides`, applied after loading).

    transformers 5.17 pops `global_head_dim` (and `num_global_key_value_heads`) from the text
    config into `per_layer_config`, and then refuses to read `head_dim` globally
    (AmbiguousGlobalPerLayerAttributeError). vLLM 0.26 reads `text_config.head_dim` for the sliding
    layers and `global_head_dim` / `num_global_key_value_heads` for the full-attention ones
    (model_arch_config_convertor.py, gemma4.py), so both come back as plain attributes, taken
    from the per-layer configs; any other per-layer difference is refused.
    """
    text = config.get_text_config()
    if not getattr(text, "is_heterogeneous", False):
        return config
    layers, types = list(text.per_layer_config), list(text.layer_types)
    shapes = {t: {(c.head_dim, c.num_key_value_heads) for c, lt in zip(layers, types) if lt == t} for t in set(types)}
    if any(len(s) != 1 for s in shapes.values()):
        raise ValueError(f"Gemma4 for vLLM: layers of one attention type differ in (head_dim, kv heads): {shapes}; "
                         "vLLM 0.26 builds one shape per type")
    text.allow_global_per_layer_attribute_access = True
    if "sliding_attention" in shapes and shapes["sliding_attention"] != {(text.head_dim, text.num_key_value_heads)}:
        raise ValueError(f"Gemma4 for vLLM: sliding layers have (head_dim, kv heads) {shapes['sliding_attention']}, "
                         f"the text config {(text.head_dim, text.num_key_value_heads)}; vLLM 0.26 reads the latter")
    if "full_attention" in shapes:
        (text.global_head_dim, text.num_global_key_value_heads), = shapes["full_attention"]
    return config


def _image_blocks(image_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) index of the image each token belongs to (a run of image tokens), -1 for other tokens;
    `get_block_sequence_ids_for_mask` on row indices."""
    starts = image_mask & ~torch.nn.functional.pad(image_mask[:, :-1], (1, 0), value=False)
    return torch.where(image_mask, torch.cumsum(starts.long(), dim=-1) - 1, -1)


def _gemma4_adapter(config) -> Gemma4Adapter:
    text, vision = config.text_config, config.vision_config
    if getattr(text, "enable_moe_block", False):
        raise ValueError("Gemma4 with enable_moe_block (the MoE variant) is not supported yet: its router and "
                         "experts have no FSDP units, name table or tests here")
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError("Gemma4 with use_bidirectional_attention='all' attends to later tokens and cannot "
                         "generate; use a checkpoint with 'vision' or none")
    if vision is None:
        raise ValueError("Gemma4 checkpoint without a vision_config: vlrl trains vision-language models")
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    multimodal = tuple(t for t in (config.image_token_id, getattr(config, "video_token_id", None),
                                   getattr(config, "audio_token_id", None)) if t is not None)
    banned = tuple(t for t in (config.boi_token_id, config.eoi_token_id, getattr(config, "video_token_id", None),
                               getattr(config, "audio_token_id", None), getattr(config, "boa_token_id", None),
                               getattr(config, "eoa_token_index", None)) if t is not None)
    return Gemma4Adapter(
        name="gemma4",
        hf_architecture="Gemma4ForConditionalGeneration",
        image_token_id=config.image_token_id,
        extra_banned_ids=banned,
        patch_size=vision.patch_size,
        pooling=vision.pooling_kernel_size,
        max_soft_tokens=int(getattr(vision, "default_output_length", None) or 280),
        pad_token_id=pad,
        bidirectional_images=getattr(text, "use_bidirectional_attention", None) == "vision",
        sliding_window=text.sliding_window,
        softcap=getattr(text, "final_logit_softcapping", None),
        per_layer_inputs=bool(getattr(text, "hidden_size_per_layer_input", 0)),
        kv_shared_layers=int(getattr(text, "num_kv_shared_layers", 0) or 0),
        multimodal_ids=multimodal,
    )


# --- tiny checkpoint ----------------------------------------------------------------------------
TINY_PATCH, TINY_POOLING, TINY_SOFT_TOKENS = 8, 2, 70  # 280 patches of 8x8; a 56x56 image takes 64 soft tokens


def _tiny_config(size: SizeSpec, tokenizer):
    """Four decoder layers (sliding, full, sliding, full), the last two reusing the first two's keys
    and values; per-layer inputs 8 wide; a 16-token window, smaller than an image, so the image
    blocks of the sliding layers are cut by it; heads of 32 (sliding) and 64 (full), one KV head;
    soft-capped logits; lm_head untied."""
    from models.families.tiny import vocab_size

    boi, eoi, image, video, boa, eoa, audio = token_ids(tokenizer, BOI, EOI, IMAGE, VIDEO, BOA, EOA, AUDIO)
    vocab = vocab_size(size, tokenizer)
    # At least 32: with two head sizes and no FA4, vLLM 0.26 runs Gemma4 on Triton attention
    # (models/config.py Gemma4Config.verify_and_update_config), which refuses head sizes below 32.
    head_dim = max(32, size.text_hidden // size.text_heads)
    text = dict(
        model_type="gemma4_text", vocab_size=vocab, hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate, num_hidden_layers=4, num_attention_heads=size.text_heads,
        num_key_value_heads=1, head_dim=head_dim, global_head_dim=2 * head_dim,  # one KV head, as small released sizes
        max_position_embeddings=size.max_positions, rms_norm_eps=1e-6, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        use_bidirectional_attention="vision", final_logit_softcapping=30.0,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0,
    )
    vision = dict(
        model_type="gemma4_vision", hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
        num_hidden_layers=size.vision_depth, num_attention_heads=size.vision_heads,
        num_key_value_heads=size.vision_heads, head_dim=size.vision_hidden // size.vision_heads,
        patch_size=TINY_PATCH, pooling_kernel_size=TINY_POOLING, position_embedding_size=64,
        default_output_length=TINY_SOFT_TOKENS,  # vLLM's token count reads it
    )
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, boi_token_id=boi, eoi_token_id=eoi,
        image_token_id=image, video_token_id=video, boa_token_id=boa, eoa_token_index=eoa, audio_token_id=audio,
        tie_word_embeddings=False, architectures=["Gemma4ForConditionalGeneration"],
    )
    # transformers keeps the full-attention head size in per_layer_config; vLLM reads global_head_dim,
    # which the released config.json files carry too.
    config.text_config.global_head_dim = 2 * head_dim
    return config


def _tiny_image_processor(size: SizeSpec):
    cls = getattr(transformers, "Gemma4ImageProcessorPil", None) or transformers.Gemma4ImageProcessor
    return cls(patch_size=TINY_PATCH, pooling_kernel_size=TINY_POOLING, max_soft_tokens=TINY_SOFT_TOKENS)


register(Family(
    model_type="gemma4",
    adapter=_gemma4_adapter,
    image_rules={"Gemma4Processor": Gemma4Images},
    vllm=VLLMNames(
        prefixes=(
            (r"^model\.language_model\.", "language_model.model."),
            (r"^model\.vision_tower\.", "vision_tower."),
            (r"^model\.embed_vision\.", "embed_vision."),
            (r"^lm_head\.", "language_model.lm_head."),
        ),
        stacking_scopes=("language_model.model.layers.",),
        mm_prefix=True,
    ),
    tiny=TinySpec(
        model_class="Gemma4ForConditionalGeneration", processor_class="Gemma4Processor", config=_tiny_config,
        image_processor=_tiny_image_processor,
        extra_tokens=((BOI, True), (IMAGE, True), (EOI, True), (VIDEO, True), (BOA, True), (AUDIO, True),
                      (EOA, True), (END_OF_TURN, True)),
        image_part=IMAGE, end_of_turn=END_OF_TURN,
        # Gemma4Processor (transformers, and vLLM's processor through it) reads these by name.
        named_tokens=(("image_token", IMAGE), ("boi_token", BOI), ("eoi_token", EOI), ("audio_token", AUDIO),
                      ("boa_token", BOA), ("eoa_token", EOA)),
        processor_fields=lambda size: {"image_seq_length": TINY_SOFT_TOKENS},
    ),
))
