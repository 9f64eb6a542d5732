"""LLaVA (1.5 layout): a CLIP/SigLIP tower at one fixed square size, an MLP projector, any decoder.

Every image is resized to the tower's square input and becomes the same run of `<image>` tokens,
one per patch of the selected vision layer (`image_tokens`); positions are plain 1-D, so
sequences pack like text. The tiny checkpoint puts a CLIP tower over a Qwen2 decoder and saves
in the pre-4.52 hub layout (`language_model.*`, `vision_tower.*`, `multi_modal_projector.*`).
vLLM 0.26 builds the tower only up to `vision_feature_layer` and then without post_layernorm,
and keeps the `vision_model.` level of the tower that transformers 5 dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from PIL import Image
from torch import nn

from data.images import to_rgb
from data.processing import ImageRule, size_field
from models.families.tiny import (
    IMAGE_MEAN, IMAGE_STD, PATCH_SIZE, SizeSpec, TinySpec, fixed_image_side, text_config, token_ids,
)
from models.family import Family, FamilyAdapter, VLLMNames, register


def image_tokens(grid_row, extra: int) -> int:
    """Placeholder tokens of one image: one per patch of its (1, h, w) grid, plus `extra` (CLS: +1)."""
    return int(torch.as_tensor(grid_row).prod()) + extra


class FixedSizeImages(ImageRule):
    """LLaVA: every image resized to the vision tower's square input; a fixed `<image>` run per image.

    pixel_values: (images, 3, H, W); image_grid_thw: (1, H / patch, W / patch) per image, one
    token per patch (the CLS token is dropped under the "default" feature strategy, kept under
    "full" as one more token, written as a row (1, 1, 1) more — see `expansion`).
    """

    placeholder = "<image>"

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor
        crop = getattr(image_processor, "crop_size", None) or getattr(image_processor, "size", None)
        side = size_field(crop, "height") or size_field(crop, "shortest_edge")
        self.size = (int(size_field(crop, "height") or side), int(size_field(crop, "width") or side))
        self.patch_size = int(config["patch_size"])
        self.extra = int(config.get("num_additional_image_tokens", 0))
        if config.get("vision_feature_select_strategy", "default") == "default":
            self.extra -= 1

    def prepare(self, image):
        image = to_rgb(image)
        if image.size == (self.size[1], self.size[0]):
            return image
        return image.resize((self.size[1], self.size[0]), resample=Image.Resampling.BICUBIC)

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        h, w = self.size[0] // self.patch_size, self.size[1] // self.patch_size
        return pixels, torch.tensor([[1, h, w]] * len(images))

    def expansion(self, grid_row: torch.Tensor) -> str:
        return self.placeholder * image_tokens(grid_row, self.extra)



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
        return image_tokens(grid_row, self.cls_token)

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


# --- vLLM ---------------------------------------------------------------------------------------
# vLLM's LlavaForConditionalGeneration / Gemma3ForConditionalGeneration mappers: current
# transformers names first, then the pre-4.52 hub layout, which is already vLLM's own.
#
# transformers 5 builds the CLIP/SigLIP tower without its `vision_model.` level
# (`model.vision_tower.encoder.layers.0...`, saved as `vision_tower.encoder...`); vLLM 0.26 keeps
# it (`vision_tower.vision_model.encoder...`) and its LLaVA/Gemma3 mappers do not add it, so the
# name table adds it, and so does the rename refit applies before vLLM's `load_weights`.
TOWER_WITHOUT_VISION_MODEL = r"vision_tower\.(?!vision_model\.)"
LLAVA_PREFIXES = (
    (r"^model\.language_model\.", "language_model.model."),
    (rf"^model\.{TOWER_WITHOUT_VISION_MODEL}", "vision_tower.vision_model."),
    (rf"^{TOWER_WITHOUT_VISION_MODEL}", "vision_tower.vision_model."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^language_model\.model\.", "language_model.model."),
    (r"^language_model\.lm_head\.", "language_model.lm_head."),
    (r"^vision_tower\.", "vision_tower."),
    (r"^multi_modal_projector\.", "multi_modal_projector."),
)
ADD_VISION_MODEL = ((rf"^(model\.)?{TOWER_WITHOUT_VISION_MODEL}", r"\1vision_tower.vision_model."),)
# vLLM's CLIP/SigLIP attention fuses q/k/v into qkv_proj; their MLP is fc1/fc2.
LLAVA_STACKING = ("language_model.model.layers.", "vision_tower.vision_model.encoder.layers.")


def _vllm_skips(config: dict) -> dict:
    """vLLM's `init_vision_tower_for_llava`: the tower stops at `vision_feature_layer` (the deepest
    of a list; a negative index k keeps layers + k + 1 of them) and has post_layernorm only when
    every layer is built. The SigLIP head is never built."""
    total = int(config["vision_config"].get("num_hidden_layers", 0))
    layers = config.get("vision_feature_layer", -2)
    # vllm.model_executor.models.utils.get_layer_index
    kept = max(total + k + 1 if k < 0 else k for k in (layers if isinstance(layers, list) else [layers]))
    return {"vision_layers": kept, "post_layernorm": kept == total}


# --- tiny checkpoint ----------------------------------------------------------------------------
# A CLIP tower over a Qwen2 decoder at one square size, the second-to-last layer's patch features
# (CLS dropped), a 2-layer MLP projector; one <image> token per patch.
def _tiny_config(size: SizeSpec, tokenizer):
    text = text_config(size, tokenizer, model_type="qwen2", max_window_layers=size.text_layers,
                       use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    vision = dict(model_type="clip_vision_model", hidden_size=size.vision_hidden,
                  intermediate_size=size.vision_intermediate, num_hidden_layers=size.vision_depth,
                  num_attention_heads=size.vision_heads, image_size=fixed_image_side(size), patch_size=PATCH_SIZE,
                  projection_dim=size.text_hidden, hidden_act="quick_gelu")
    return transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=token_ids(tokenizer, "<image>")[0],
        image_seq_length=(fixed_image_side(size) // PATCH_SIZE) ** 2, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
    )


def _tiny_image_processor(size: SizeSpec):
    side = fixed_image_side(size)
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
               image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))


register(Family(
    model_type="llava",
    adapter=_llava_adapter,
    image_rules={"LlavaProcessor": FixedSizeImages},
    vllm=VLLMNames(prefixes=LLAVA_PREFIXES, stacking_scopes=LLAVA_STACKING,
                   vision_transformer="vision_tower.vision_model.", skips=_vllm_skips, load_renames=ADD_VISION_MODEL),
    tiny=TinySpec(
        model_class="LlavaForConditionalGeneration", processor_class="LlavaProcessor", config=_tiny_config,
        image_processor=_tiny_image_processor, extra_tokens=(("<image>", True), ("</s>", True)),
        image_part="<image>", end_of_turn="</s>",
        processor_fields=lambda size: {"patch_size": PATCH_SIZE, "vision_feature_select_strategy": "default",
                                       "num_additional_image_tokens": 1, "image_token": "<image>"},
    ),
))
