"""Family adapters: everything model-family specific lives here and the rest asks the adapter.

An adapter knows a family's special token ids, how it computes position ids, how many
placeholder tokens an image takes, how the vision tower is called and how its features enter
the language model, which submodules are the FSDP units, how the inputs of the family's own
`model.model(...)` forward are spelled (for the built-in engine), and which tokens must never
be sampled. Adding a family means one adapter class and one row in `ADAPTERS`.

Two per-prompt image tensors travel through the data pipeline, the batch and the engines
for every family (their names are historical, from the first family):

- `pixel_values`: what the vision tower takes, concatenated over images along dim 0 (Qwen-VL:
  patch rows; LLaVA: one (3, H, W) image per row);
- `image_grid_thw`: one int row (t, h, w) per image saying how many placeholder tokens the
  image takes and how they are laid out (Qwen-VL: the patch grid, t·h·w / merge² tokens; LLaVA:
  (1, h, w) with h·w the fixed token count).

Position ids are kept per sequence as an (R, L) tensor. Row 0 is always the plain 1-D position,
restarting at 0 for each sequence: packed attention finds sequence boundaries from it. Qwen-VL
families add three m-rope rows (R = 4); 1-D families have R = 1.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class FamilyAdapter:
    """What every family shares; subclasses fill in the family-specific parts."""

    name: str
    hf_architecture: str
    image_token_id: int
    extra_banned_ids: tuple[int, ...] = field(default=())
    # False: the language model cannot run several sequences in one packed row (the policy then
    # runs each sequence of a micro-batch on its own; see Policy.hidden_states).
    packable: bool = True
    # False: prompts of different lengths must not share a right-padded batch in the built-in
    # engine (a sliding-window cache counts padding slots as context); it then generates one
    # prompt (with its n samples, all the same length) at a time.
    batch_with_padding: bool = True
    # True: on CUDA, `model.attn_implementation: auto` runs packed rows through the varlen kernel
    # (models/attention.py); set only for families whose varlen path was checked on a GPU.
    varlen_attention: bool = False
    # The token the family's chat template writes right after an assistant message: generation
    # stops on it and SFT targets end with it. "" for none (stop ids then come from the folder's
    # generation_config.json and tokenizer alone).
    end_of_turn: str = ""

    @property
    def banned_token_ids(self) -> list[int]:
        """Tokens a response must never contain: sampling one breaks the next forward."""
        return [self.image_token_id, *self.extra_banned_ids]

    # Checkpoint-file names → transformers' current module names: (pattern, replacement), first
    # match wins. Hub checkpoints saved before transformers 4.52 (and transformers 5's
    # save_pretrained, which converts back on save) use the old layout.
    legacy_weight_names: tuple[tuple[str, str], ...] = ()

    def canonical_weight_name(self, name: str) -> str:
        """A checkpoint key in transformers' current naming."""
        for pattern, repl in self.legacy_weight_names:
            if re.match(pattern, name):
                return re.sub(pattern, repl, name, count=1)
        return name

    # --- images -----------------------------------------------------------------------------
    def image_token_count(self, grid_row: torch.Tensor) -> int:
        """Placeholder tokens one image (one `image_grid_thw` row) takes in the prompt."""
        return int(torch.as_tensor(grid_row).prod())

    def pixel_rows(self, grid: torch.Tensor) -> int:
        """Rows of `pixel_values` the images of `grid` take."""
        return int(grid.shape[0])

    def check_pixels(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        """Raise ValueError when `pixels` does not hold exactly the images `grid` describes."""
        need = self.pixel_rows(grid)
        if pixels.shape[0] != need:
            raise ValueError(f"pixel_values has {pixels.shape[0]} rows, image_grid_thw {grid.tolist()} needs {need}")

    def dummy_vision_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid (pixel_values, image_grid_thw), for zero-weighted keep-alive forwards."""
        raise NotImplementedError

    def image_features(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """Vision features of the images, in image order: a list of streams, each (tokens, hidden).

        Stream 0 replaces the image placeholders in the input embeddings; further streams (Qwen3-VL's
        deepstack levels) are handed to `run_language_model` aligned with the placeholders.
        """
        raise NotImplementedError

    # --- positions --------------------------------------------------------------------------
    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """(1, L) plain positions of one sequence; m-rope families return (4, L)."""
        self._check_placeholders(input_ids, image_grid_thw)
        return torch.arange(input_ids.numel()).unsqueeze(0)

    def _check_placeholders(self, input_ids: torch.Tensor, grid: torch.Tensor | None) -> None:
        have = int((input_ids == self.image_token_id).sum())
        need = 0 if grid is None else sum(self.image_token_count(g) for g in grid)
        if have != need:
            raise ValueError(f"sequence has {have} image placeholder tokens, its images need {need}")

    def next_rope_position(self, position_ids: torch.Tensor) -> int:
        """The position a token appended after this (R, L) sequence takes."""
        return int(position_ids[-1].max()) + 1 if position_ids.shape[1] else 0

    def rope_rows(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rows of (R, ...) position ids the family's own forward takes."""
        return position_ids[:1]

    @property
    def rope_row_count(self) -> int:
        """How many rows `rope_rows` keeps."""
        return 1

    # --- forward ----------------------------------------------------------------------------
    def run_language_model(self, model: nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor,
                           image_mask: torch.Tensor, extra_streams: list[torch.Tensor]) -> torch.Tensor:
        """Last hidden states (B, L, H) of the decoder on input embeddings.

        `position_ids` is (R, B, L) as packed; row 0 restarting at 0 marks packed sequences.
        """
        out = self.language_model(model)(inputs_embeds=embeds, position_ids=position_ids[0], use_cache=False)
        return out.last_hidden_state

    def engine_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                      pixels: torch.Tensor | None, grid: torch.Tensor | None) -> dict:
        """Keyword arguments of the family's `model.model(...)` for the built-in engine.

        `positions` holds `rope_rows` of each row's position ids, shape (r, B, L).
        """
        kwargs = dict(input_ids=input_ids, position_ids=positions[0], attention_mask=attention_mask)
        if pixels is not None:
            kwargs["pixel_values"] = pixels
        return kwargs

    def rebuild_buffers(self, module: nn.Module, device) -> bool:
        """Refill the non-persistent buffers of a config-less module built on meta; False if unknown."""
        return False

    # --- module structure -------------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.language_model

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(self.language_model(model).layers)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.language_model(model).norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return self.language_model(model).embed_tokens

    def tp_plan(self) -> dict[str, str]:
        """Per-decoder-block tensor-parallel plan (submodule → 'colwise' | 'rowwise')."""
        return {
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }

    # --- vLLM prompts and processor -----------------------------------------------------------
    # vLLM 0.26 takes a token prompt as un-expanded: its multimodal processor replaces, for each
    # image in order, the first target token after the previous image with that image's
    # replacement ids (`BaseMultiModalProcessor._apply_prompt_updates` → `apply_token_matches`).
    # The trainer's ids are already expanded, so `vllm_collapse` undoes the family's expansion and
    # `vllm_expand` redoes it the way vLLM does; the engine checks that the two round-trip.
    def vllm_collapse(self, ids: list[int], vocab: Mapping[str, int]) -> tuple[list[int], list[list[int]]]:
        """(the prompt vLLM expands itself, each image's replacement ids as vLLM inserts them).

        Default (Qwen-VL, LLaVA): vLLM's `PromptReplacement` targets one image token and inserts
        the image's whole run of it, so each run becomes one token.
        """
        out: list[int] = []
        runs: list[list[int]] = []
        for token in ids:
            if token == self.image_token_id and out and out[-1] == token:
                runs[-1].append(token)
                continue
            out.append(token)
            if token == self.image_token_id:
                runs.append([token])
        return out, runs

    def vllm_target(self, vocab: Mapping[str, int]) -> int:
        """The token vLLM replaces with an image's replacement ids."""
        return self.image_token_id

    def vllm_expand(self, ids: list[int], replacements: list[list[int]], vocab: Mapping[str, int]) -> list[int]:
        """The prompt vLLM 0.26 runs for a collapsed prompt: image i's target becomes replacements[i]."""
        return _replace_targets(ids, self.vllm_target(vocab), replacements)

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict:
        """`mm_processor_kwargs` that make vLLM's HF processor see the images as the trainer's does.

        Default (LLaVA): the trainer calls the processor with its defaults on images already at the
        tower's square size, so vLLM needs none either.
        """
        return {}


def _replace_targets(ids: list[int], target: int, replacements: list[list[int]]) -> list[int]:
    """Each replacement, in order, in place of the first `target` after the previous replacement.

    vLLM finds every image's first match from the end of the last replacement and applies the
    earliest one at a time, which for one target token is this left-to-right walk. A missing
    target is an error here (vLLM would fall back to matching on decoded text).
    """
    out: list[int] = []
    start = 0
    for i, repl in enumerate(replacements):
        try:
            at = ids.index(target, start)
        except ValueError:
            raise ValueError(f"vLLM prompt: no image target token {target} left for image {i}") from None
        out += ids[start:at] + list(repl)
        start = at + 1
    return out + ids[start:]


@dataclass
class QwenVLAdapter(FamilyAdapter):
    """Qwen2-VL / Qwen2.5-VL: m-rope positions, vision tower `model.visual`, decoder in `model.language_model`.

    pixel_values: (patches, 3·temporal_patch·patch²) rows; image_grid_thw: the patch grid (t, h, w).
    """

    legacy_weight_names: tuple[tuple[str, str], ...] = (
        (r"^visual\.", "model.visual."),
        (r"^model\.(?!visual\.|language_model\.)", "model.language_model."),
    )
    varlen_attention: bool = True  # tests/gpu/test_varlen_attention.py on the H200 (Qwen2.5-VL)
    end_of_turn: str = "<|im_end|>"  # ChatML
    video_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    spatial_merge_size: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2

    @property
    def pixel_factor(self) -> int:
        """Image sides must be multiples of this many pixels (patch × merge)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def banned_token_ids(self) -> list[int]:
        return [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        return int(torch.as_tensor(grid_thw).prod()) // self.spatial_merge_size**2

    def pixel_rows(self, grid: torch.Tensor) -> int:
        return int(grid.prod(dim=-1).sum())

    def dummy_vision_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        grid = torch.tensor([[1, self.spatial_merge_size, self.spatial_merge_size]])
        pixels = torch.zeros(int(grid.prod()), 3 * self.temporal_patch_size * self.patch_size**2)
        return pixels.to(device), grid.to(device)

    def image_features(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        out = self.vision_tower(model)(pixels, grid_thw=grid)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(feats, (tuple, list)):
            feats = torch.cat(list(feats))
        return [feats]

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """(4, L) positions of one sequence: row 0 the plain 1-D positions, rows 1–3 m-rope (t, h, w).

        Text runs advance all three m-rope rows together; an image of merged grid (t, h, w) takes
        positions start + (t_i, h_i, w_i) and the text after it resumes at start + max(t, h, w).
        Row 0 lets attention see sequence boundaries when sequences are packed into one row.
        """
        ids = input_ids.tolist()
        n = len(ids)
        rope = torch.empty(3, n, dtype=torch.long)
        grids = [] if image_grid_thw is None else image_grid_thw.tolist()
        pos, i, img = 0, 0, 0
        while i < n:
            if ids[i] != self.image_token_id:
                j = i
                while j < n and ids[j] != self.image_token_id:
                    j += 1
                rope[:, i:j] = torch.arange(pos, pos + j - i)
                pos += j - i
                i = j
                continue
            if img >= len(grids):
                raise ValueError(f"sequence has more image placeholder runs than images ({len(grids)} grids)")
            t, h, w = grids[img]
            h, w = h // self.spatial_merge_size, w // self.spatial_merge_size
            count = t * h * w
            if ids[i : i + count] != [self.image_token_id] * count:
                raise ValueError(
                    f"image {img} needs {count} placeholder tokens at position {i}; the sequence has fewer"
                )
            grid = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            ).reshape(3, -1)
            rope[:, i : i + count] = grid + pos
            pos += max(t, h, w)
            i += count
            img += 1
        if img != len(grids):
            raise ValueError(f"sequence has {img} image placeholder runs but {len(grids)} images")
        return torch.cat([torch.arange(n).unsqueeze(0), rope], dim=0)

    def next_rope_position(self, position_ids: torch.Tensor) -> int:
        """The m-rope position a token appended after this (4, L) sequence takes."""
        return int(position_ids[1:].max()) + 1 if position_ids.shape[1] else 0

    def rope_rows(self, position_ids: torch.Tensor) -> torch.Tensor:
        return position_ids[1:]

    @property
    def rope_row_count(self) -> int:
        return 3

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        out = self.language_model(model)(inputs_embeds=embeds, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state

    def engine_inputs(self, input_ids, positions, attention_mask, pixels, grid):
        kwargs = dict(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask)
        if pixels is not None:
            kwargs.update(pixel_values=pixels, image_grid_thw=grid)
        return kwargs

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict:
        # Images arrive with sides on the patch × merge grid within these limits; the trainer's
        # processor is told not to resize them, and so is vLLM's (Qwen2VLImageProcessor.size).
        return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}, "do_resize": False}


@dataclass
class Qwen3VLAdapter(QwenVLAdapter):
    """Qwen3-VL: Qwen-VL positions and inputs, plus DeepStack.

    The vision tower also returns features of a few intermediate blocks (one stream per
    deepstack level, aligned with the image tokens); the decoder adds level k to the hidden
    states at the image positions after its k-th layer. Position ids are Qwen2-VL's for images
    (interleaved m-rope sections are the rotary embedding's business, not the ids').
    """

    varlen_attention: bool = False  # not yet checked on a GPU

    def image_features(self, model, pixels, grid):
        out = self.vision_tower(model)(pixels, grid_thw=grid)
        return [out.pooler_output, *out.deepstack_features]

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        kwargs = {}
        if extra_streams:
            kwargs = dict(visual_pos_masks=image_mask, deepstack_visual_embeds=list(extra_streams))
        out = self.language_model(model)(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **kwargs)
        return out.last_hidden_state


# LLaVA-style checkpoints (LLaVA, Gemma3) before transformers 4.52: language_model.model.*,
# language_model.lm_head.*, vision_tower.*, multi_modal_projector.* at the top level.
_LLAVA_LEGACY_NAMES = (
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
)


@dataclass
class LlavaAdapter(FamilyAdapter):
    """LLaVA (1.5 layout): a CLIP/SigLIP tower at one fixed square size, an MLP projector, any decoder.

    Every image becomes the same run of `<image>` tokens, one per patch of the selected vision
    layer (plus the CLS token under the "full" feature strategy); positions are plain 1-D, so
    sequences pack like text. pixel_values: (images, 3, S, S); image_grid_thw: (1, S/p, S/p).
    """

    legacy_weight_names: tuple[tuple[str, str], ...] = _LLAVA_LEGACY_NAMES
    end_of_turn: str = "</s>"  # LLaVA-1.5 (Vicuna/Llama tokenizer): the eos closes an assistant turn
    image_size: int = 336
    patch_size: int = 14
    cls_token: int = 0  # 1 under vision_feature_select_strategy="full"
    feature_layer: int = -2  # the vision hidden state the projector reads

    def image_token_count(self, grid_row: torch.Tensor) -> int:
        return int(torch.as_tensor(grid_row).prod()) + self.cls_token

    def dummy_vision_inputs(self, device):
        side = self.image_size // self.patch_size
        return torch.zeros(1, 3, self.image_size, self.image_size, device=device), torch.tensor([[1, side, side]])

    def image_features(self, model, pixels, grid):
        feats = _encoder_layer_output(self.vision_tower(model), pixels, self.feature_layer)
        if not self.cls_token:
            feats = feats[:, 1:]
        return [model.model.multi_modal_projector(feats).flatten(0, 1)]

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def vllm_collapse(self, ids, vocab):
        """Each image's `<image>` run back to one `<image>` (vLLM's `LlavaMultiModalProcessor` target).

        Every image takes the same count, so a run of adjacent images splits by it.
        """
        out, runs = super().vllm_collapse(ids, vocab)
        per_image = (self.image_size // self.patch_size) ** 2 + self.cls_token
        if any(len(run) % per_image for run in runs):
            raise ValueError(f"vLLM prompt: an <image> run is not a multiple of {per_image} tokens per image")
        collapsed: list[int] = []
        for token in out:
            if token == self.image_token_id:
                collapsed += [token] * (len(runs[0]) // per_image)
                runs.pop(0)
            else:
                collapsed.append(token)
        count = collapsed.count(self.image_token_id)
        return collapsed, [[self.image_token_id] * per_image] * count


def _encoder_layer_output(tower: nn.Module, pixels: torch.Tensor, feature_layer: int) -> torch.Tensor:
    """`hidden_states[feature_layer]` of a CLIP/SigLIP tower, taken by a hook on that encoder layer.

    The model's own `output_hidden_states` capture is looked up by the tower's class, which FSDP
    replaces when it wraps the tower, so the layer's output is caught here instead. Index k >= 1
    is the output of layer k - 1; negative indices count from the last layer's output (-1).
    """
    layers = getattr(tower, "vision_model", tower).encoder.layers
    if feature_layer == 0 or not -len(layers) <= feature_layer <= len(layers):
        raise ValueError(f"vision_feature_layer {feature_layer} is not an encoder layer output of {len(layers)} layers")
    index = len(layers) + feature_layer if feature_layer < 0 else feature_layer - 1
    captured: list[torch.Tensor] = []
    handle = layers[index].register_forward_hook(
        lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        out = tower(pixels)
    finally:
        handle.remove()
    # FSDP gathers the tower's weights for backward when the gradient reaches the tower's
    # outputs; a gradient entering at an inner layer alone would find them freed. Tying the
    # tower's output in with weight zero makes that happen first (it depends on this layer).
    return captured[0] + out.last_hidden_state.sum() * 0.0


def _llava_adapter(config) -> LlavaAdapter:
    vc = config.vision_config
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError(f"llava: vision_feature_layer {config.vision_feature_layer} (several layers) is not supported")
    return LlavaAdapter(
        name="llava",
        hf_architecture="LlavaForConditionalGeneration",
        image_token_id=getattr(config, "image_token_id", None) or config.image_token_index,
        image_size=vc.image_size,
        patch_size=vc.patch_size,
        cls_token=1 if config.vision_feature_select_strategy == "full" else 0,
        feature_layer=config.vision_feature_layer,
    )


@dataclass
class Idefics3Adapter(FamilyAdapter):
    """SmolVLM (Idefics3): each image split into square tiles plus a downscaled global tile.

    Every tile becomes `image_seq_len` `<image>` tokens (vision patches pixel-shuffled by
    scale_factor², then projected); the tile runs are framed by `<fake_token_around_image>`,
    `<row_i_col_j>` and `<global-img>` text tokens. Positions are plain 1-D, so sequences pack.
    pixel_values: (tiles, 3, S, S) per prompt — the model takes them as (batch, tiles, 3, S, S),
    images laid along dim 1, which `engine_inputs` and `image_features` add; image_grid_thw:
    (tiles, rows, cols) per image (rows = cols = 0 when the image was not split).
    """

    end_of_turn: str = "<end_of_utterance>"
    image_size: int = 512
    image_seq_len: int = 64
    patch_size: int = 16

    def image_token_count(self, grid_row: torch.Tensor) -> int:
        return int(grid_row[0]) * self.image_seq_len

    def pixel_rows(self, grid: torch.Tensor) -> int:
        return int(grid[:, 0].sum())

    def dummy_vision_inputs(self, device):
        # Not zeros: the model drops all-zero tiles as batch padding.
        return torch.ones(1, 3, self.image_size, self.image_size, device=device), torch.tensor([[1, 0, 0]])

    def image_features(self, model, pixels, grid):
        out = model.model.get_image_features(pixel_values=pixels.unsqueeze(0))
        return [torch.cat(list(out.pooler_output))]

    def engine_inputs(self, input_ids, positions, attention_mask, pixels, grid):
        kwargs = dict(input_ids=input_ids, position_ids=positions[0], attention_mask=attention_mask)
        if pixels is not None:
            kwargs["pixel_values"] = pixels.unsqueeze(0)
        return kwargs

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_model

    def vllm_collapse(self, ids, vocab):
        """Each framed image block back to the one `<image>` vLLM's Idefics3 processor replaces.

        vLLM 0.26 (`Idefics3MultiModalProcessor._get_prompt_updates`) targets the text "<image>"
        and inserts `Idefics3ProcessingInfo.get_image_repl` tokenized on its own: the tiles
        (`<fake_token_around_image><row_r_col_c>` + image_seq_len `<image>`, "\n" after each row),
        "\n", then `<fake_token_around_image><global-img>` + image_seq_len `<image>` +
        `<fake_token_around_image>`; unsplit images are the global part alone. The block starts and
        ends with special tokens, so the trainer's whole-text tokenization holds the same ids.
        """
        fake, glob = vocab["<fake_token_around_image>"], vocab["<global-img>"]
        out: list[int] = []
        blocks: list[list[int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != fake:
                out.append(ids[i])
                i += 1
                continue
            try:
                g = ids.index(glob, i)
            except ValueError:
                raise ValueError(f"vLLM prompt: <fake_token_around_image> at {i} opens no image block "
                                 "(no <global-img> after it)") from None
            end = g + 1 + self.image_seq_len
            if ids[g - 1] != fake or ids[g + 1 : end] != [self.image_token_id] * self.image_seq_len \
                    or end >= len(ids) or ids[end] != fake:
                raise ValueError(f"vLLM prompt: the image block at {i} does not end in <fake_token_around_image>"
                                 f"<global-img> + {self.image_seq_len} <image> + <fake_token_around_image>")
            out.append(self.image_token_id)
            blocks.append(ids[i : end + 1])
            i = end + 1
        return out, blocks

    def vllm_processor_kwargs(self, min_pixels, max_pixels):
        # The trainer brings each image to the processor's longest edge on the tile grid itself and
        # calls the processor with its own resize left on and do_image_splitting=True (data/processing.py
        # SplitImages); on such an image that resize keeps the size. vLLM passes the same kwargs to
        # Idefics3Processor and to Idefics3ImageProcessor.get_number_of_image_patches, which sizes the
        # replacement assuming the resize: with do_resize=False, vLLM's start-up profiling image (one
        # tile) was not split while the count expected 2x2 tiles, and the engine failed to start.
        return {"do_image_splitting": True}

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.model.text_model


def _idefics3_adapter(config) -> Idefics3Adapter:
    vc = config.vision_config
    seq = (vc.image_size // vc.patch_size) ** 2 // config.scale_factor**2
    return Idefics3Adapter(
        name="idefics3",
        hf_architecture="Idefics3ForConditionalGeneration",
        image_token_id=config.image_token_id,
        image_size=vc.image_size,
        image_seq_len=seq,
        patch_size=vc.patch_size,
    )


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
        return int(torch.as_tensor(grid_row).prod())

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
        out = _replace_targets(ids, self.vllm_target(vocab), replacements)
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


def _qwen_adapter(config, name: str, arch: str, cls=QwenVLAdapter) -> QwenVLAdapter:
    vc = config.vision_config
    return cls(
        name=name,
        hf_architecture=arch,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        spatial_merge_size=vc.spatial_merge_size,
        patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size,
    )


ADAPTERS = {
    "qwen2_vl": lambda cfg: _qwen_adapter(cfg, "qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": lambda cfg: _qwen_adapter(cfg, "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": lambda cfg: _qwen_adapter(cfg, "qwen3_vl", "Qwen3VLForConditionalGeneration", Qwen3VLAdapter),
    "llava": _llava_adapter,
    "idefics3": _idefics3_adapter,
    "gemma3": _gemma3_adapter,
}


def build_adapter(config) -> FamilyAdapter:
    """The adapter for a transformers config; an unsupported family names the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model family '{model_type}' is not supported; supported families: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](config)
