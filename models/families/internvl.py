"""InternVL3 (transformers `internvl`, the "-hf" checkpoints): InternViT over tiles, pixel shuffle, an MLP, a Qwen2 decoder.

Each image is cut into square tiles of the tower's size on a grid (cols × rows) whose aspect ratio
is closest to the image's (`get_optimal_tiled_canvas`, min_patches..max_patches tiles), plus a
thumbnail of the whole image when there is more than one tile. Every tile becomes
`image_seq_length` `<IMG_CONTEXT>` tokens ((size / patch)² patches, CLS dropped, 2×2 pixel
shuffle, projected); an image's run is framed by `<img>` … `</img>`. Positions are plain 1-D,
so sequences pack. pixel_values: (tiles, 3, S, S) for all images of a prompt; image_grid_thw:
(tiles, rows, cols) per image, tiles counting the thumbnail.

The trainer brings each image to its tiled canvas (cols·S × rows·S) in one resize, so the image
processor's own resize keeps the size and only cuts the tiles; vLLM counts tiles with the same
function on the same image.

vLLM 0.26 runs the HF-format checkpoints as `InternS1ForConditionalGeneration` (interns1.py):
its mapper moves `model.language_model.` → `language_model.model.`, `model.vision_tower.` →
`vision_tower.`, `model.multi_modal_projector.` → `multi_modal_projector.`, `lm_head.` →
`language_model.lm_head.`; it keeps the tower's q/k/v separate and builds every tower layer, and
stacks the decoder's q/k/v and gate/up. It always reads the last tower layer with the CLS token
dropped (vision_feature_layer -1, strategy "default"), the only setting the adapter takes. Its
processor replaces each `<IMG_CONTEXT>` with `<img>` + the image's run + `</img>`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from PIL import Image
from torch import nn

from data.images import to_rgb
from data.processing import ImageRule
from models.families.tiny import PATCH_SIZE, SizeSpec, TinySpec, fixed_image_side, text_config, token_ids
from models.family import Family, FamilyAdapter, VLLMNames, register


def image_tokens(grid_row, seq_len: int) -> int:
    """`<IMG_CONTEXT>` tokens of one image of grid (tiles, rows, cols): `seq_len` per tile, thumbnail included."""
    return int(grid_row[0]) * seq_len


def _canvas(image_processor, width: int, height: int) -> tuple[int, int]:
    """(cols, rows) of the tile grid the image processor picks for an image of this size."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    tile = image_processor.size
    tile = (tile["height"], tile["width"]) if isinstance(tile, dict) else (tile.height, tile.width)
    return get_optimal_tiled_canvas((height, width), tile, image_processor.min_patches, image_processor.max_patches)


class TiledImages(ImageRule):
    """InternVL's tiles (see the module docstring); the placeholder is `<IMG_CONTEXT>`."""

    placeholder = "<IMG_CONTEXT>"
    start = "<img>"
    end = "</img>"

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor
        size = image_processor.size
        self.tile = int(size["height"] if isinstance(size, dict) else size.height)
        self.seq_len = int(config["image_seq_length"])

    def prepare(self, image):
        image = to_rgb(image)
        cols, rows = _canvas(self.image_processor, *image.size)
        w, h = cols * self.tile, rows * self.tile
        return image if image.size == (w, h) else image.resize((w, h), resample=Image.Resampling.BICUBIC)

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.image_processor(images=images, crop_to_patches=True, return_tensors="pt")
        grid = [[int(n), img.height // self.tile, img.width // self.tile]
                for n, img in zip(out["num_patches"], images)]
        return out["pixel_values"], torch.tensor(grid)

    def expansion(self, grid_row: torch.Tensor) -> str:
        return self.start + self.placeholder * image_tokens(grid_row, self.seq_len) + self.end


# The "-hf" checkpoints' file layout (transformers converts InternVL as LLaVA): language_model.model.*,
# language_model.lm_head.*, vision_tower.*, multi_modal_projector.* at the top level.
_LEGACY_NAMES = (
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
)


@dataclass
class InternVLAdapter(FamilyAdapter):
    """InternVL3: tiles through InternViT's last layer, CLS dropped, pixel shuffle, projector; 1-D positions."""

    legacy_weight_names: tuple[tuple[str, str], ...] = _LEGACY_NAMES
    end_of_turn: str = "<|im_end|>"  # ChatML (a Qwen2.5 decoder)
    image_size: int = 448
    image_seq_len: int = 256
    downsample_ratio: float = 0.5

    def image_token_count(self, grid_row: torch.Tensor) -> int:
        return image_tokens(grid_row, self.image_seq_len)

    def pixel_rows(self, grid: torch.Tensor) -> int:
        return int(grid[:, 0].sum())

    def dummy_vision_inputs(self, device):
        return torch.zeros(1, 3, self.image_size, self.image_size, device=device), torch.tensor([[1, 1, 1]])

    def image_features(self, model, pixels, grid):
        feats = self.vision_tower(model)(pixel_values=pixels).last_hidden_state[:, 1:]
        side = int(feats.shape[1] ** 0.5)
        feats = model.model.pixel_shuffle(feats.reshape(feats.shape[0], side, side, -1), self.downsample_ratio)
        feats = model.model.multi_modal_projector(feats.reshape(feats.shape[0], -1, feats.shape[-1]))
        return [feats.flatten(0, 1)]

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.vision_tower

    def vllm_collapse(self, ids, vocab):
        """Each `<img>` + run + `</img>` back to the one `<IMG_CONTEXT>` vLLM's InternS1 processor replaces."""
        start, end = vocab[TiledImages.start], vocab[TiledImages.end]
        out: list[int] = []
        blocks: list[list[int]] = []
        i = 0
        while i < len(ids):
            if ids[i] != start:
                out.append(ids[i])
                i += 1
                continue
            try:
                j = ids.index(end, i)
            except ValueError:
                raise ValueError(f"vLLM prompt: <img> at {i} is not closed by </img>") from None
            run = ids[i + 1 : j]
            if not run or run.count(self.image_token_id) != len(run) or len(run) % self.image_seq_len:
                raise ValueError(f"vLLM prompt: the image block at {i} is not <img> + a multiple of "
                                 f"{self.image_seq_len} <IMG_CONTEXT> + </img>")
            out.append(self.image_token_id)
            blocks.append(ids[i : j + 1])
            i = j + 1
        return out, blocks

    def vllm_processor_kwargs(self, min_pixels, max_pixels):
        # vLLM counts tiles with the image processor's get_number_of_image_patches under these kwargs,
        # and the trainer's processor call crops to patches too.
        return {"crop_to_patches": True}


def _internvl_adapter(config) -> InternVLAdapter:
    vc = config.vision_config
    if config.vision_feature_layer != -1 or config.vision_feature_select_strategy != "default":
        raise ValueError(f"internvl: vision_feature_layer {config.vision_feature_layer} with strategy "
                         f"{config.vision_feature_select_strategy!r} is not supported (InternVL3 and vLLM: -1, 'default')")
    side = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    return InternVLAdapter(
        name="internvl",
        hf_architecture="InternVLForConditionalGeneration",
        image_token_id=config.image_token_id,
        image_size=int(side),
        image_seq_len=config.image_seq_length,
        downsample_ratio=config.downsample_ratio,
    )


# --- tiny checkpoint ----------------------------------------------------------------------------
def _tiny_config(size: SizeSpec, tokenizer):
    side = fixed_image_side(size)
    text = text_config(size, tokenizer, model_type="qwen2", max_window_layers=size.text_layers,
                       use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       architectures=["Qwen2ForCausalLM"])
    vision = dict(hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                  num_hidden_layers=size.vision_depth, num_attention_heads=size.vision_heads,
                  image_size=[side, side], patch_size=[PATCH_SIZE, PATCH_SIZE])
    return transformers.InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=token_ids(tokenizer, "<IMG_CONTEXT>")[0],
        image_seq_length=_tokens_per_tile(size), downsample_ratio=0.5, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
        architectures=["InternVLForConditionalGeneration"],
    )


def _tokens_per_tile(size: SizeSpec) -> int:
    return (fixed_image_side(size) // PATCH_SIZE) ** 2 // 4  # 2x2 pixel shuffle


def _tiny_image_processor(size: SizeSpec):
    # Up to four tiles (2x2, 1x3, ...) plus the thumbnail.
    side = fixed_image_side(size)
    cls = getattr(transformers, "GotOcr2ImageProcessorPil", None) or transformers.GotOcr2ImageProcessor
    return cls(size={"height": side, "width": side}, crop_to_patches=True, min_patches=1, max_patches=4,
               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


register(Family(
    model_type="internvl",
    adapter=_internvl_adapter,
    image_rules={"InternVLProcessor": TiledImages},
    vllm=VLLMNames(
        prefixes=(
            (r"^model\.language_model\.", "language_model.model."),
            (r"^model\.vision_tower\.", "vision_tower."),
            (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
            (r"^lm_head\.", "language_model.lm_head."),
            (r"^language_model\.model\.", "language_model.model."),
            (r"^language_model\.lm_head\.", "language_model.lm_head."),
            (r"^vision_tower\.", "vision_tower."),
            (r"^multi_modal_projector\.", "multi_modal_projector."),
        ),
        stacking_scopes=("language_model.model.layers.",),
    ),
    tiny=TinySpec(
        model_class="InternVLForConditionalGeneration", processor_class="InternVLProcessor", config=_tiny_config,
        image_processor=_tiny_image_processor,
        extra_tokens=(("<img>", True), ("</img>", True), ("<IMG_CONTEXT>", True), ("<video>", True)),
        image_part="<IMG_CONTEXT>",
        # InternVLProcessor (and vLLM's processor through it) reads these, as the -hf tokenizer_config.json declares them.
        named_tokens=(("start_image_token", "<img>"), ("end_image_token", "</img>"),
                      ("context_image_token", "<IMG_CONTEXT>"), ("video_token", "<video>")),
        processor_fields=lambda size: {"image_seq_length": _tokens_per_tile(size)},
    ),
))
