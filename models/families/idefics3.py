"""SmolVLM (Idefics3): each image split into square tiles plus a downscaled global tile.

Every tile becomes `image_seq_len` `<image>` tokens (vision patches pixel-shuffled by
scale_factor², then projected); the tile runs are framed by `<fake_token_around_image>`,
`<row_i_col_j>` and `<global-img>` text tokens. Positions are plain 1-D, so sequences pack.
The tiny checkpoint is a SigLIP-style tower over a Llama decoder, in the family's only layout
(`model.text_model.*`, `model.vision_model.*`, `model.connector.*`), which vLLM 0.26 keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from PIL import Image
from torch import nn

from data.images import to_rgb
from data.processing import ImageRule, size_field
from models.families.tiny import PATCH_SIZE, SizeSpec, TinySpec, fixed_image_side, text_config, token_ids
from models.family import Family, FamilyAdapter, VLLMNames, register


def image_tokens(grid_row, seq_len: int) -> int:
    """`<image>` tokens of one image of grid (tiles, rows, cols): `seq_len` per tile, the global one included."""
    return int(grid_row[0]) * seq_len


class SplitImages(ImageRule):
    """SmolVLM (Idefics3): images tiled into squares of the vision tower's size plus a global tile.

    `prepare` brings an image to the size the image processor would tile (longest edge at the
    processor's `size`, both sides multiples of the tile side), in one resize, so the processor's
    own resize keeps that size and it only cuts tiles and downscales the global view; the engine
    calls the processor the same way (vLLM's tile count assumes that resize). pixel_values: (tiles, 3, S, S) for all images of
    the prompt; image_grid_thw: (tiles, rows, cols) per image. Each image's placeholder expands
    to the Idefics3 layout: per tile `<fake_token_around_image><row_r_col_c>` + image_seq_len
    `<image>`, a newline after each row, then the framed `<global-img>` tile.
    """

    placeholder = "<image>"
    fake = "<fake_token_around_image>"
    global_tag = "<global-img>"

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor
        self.longest = int(size_field(image_processor.size, "longest_edge"))
        self.tile = int(image_processor.max_image_size["longest_edge"])
        self.seq_len = int(config["image_seq_len"])

    def prepare(self, image):
        image = to_rgb(image)
        w, h = image.size
        scale = self.longest / max(w, h)
        w, h = max(1, round(w * scale)), max(1, round(h * scale))
        w, h = (-(-w // self.tile) * self.tile, -(-h // self.tile) * self.tile)
        return image if image.size == (w, h) else image.resize((w, h), resample=Image.Resampling.LANCZOS)

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.image_processor(images=[images], do_image_splitting=True,
                                   return_row_col_info=True, return_tensors="pt")
        rows, cols = out["rows"][0], out["cols"][0]
        grid = torch.tensor([[r * c + 1, r, c] for r, c in zip(rows, cols)])
        return out["pixel_values"][0], grid

    def expansion(self, grid_row: torch.Tensor) -> str:
        _, rows, cols = (int(v) for v in grid_row)
        run = self.placeholder * self.seq_len
        glob = f"{self.fake}{self.global_tag}{run}{self.fake}"
        if rows == 0 and cols == 0:
            return glob
        tiles = "".join("".join(f"{self.fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                        for r in range(rows))
        return f"{tiles}\n{glob}"



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
        return image_tokens(grid_row, self.image_seq_len)

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


# --- tiny checkpoint ----------------------------------------------------------------------------
def _tiny_config(size: SizeSpec, tokenizer):
    text = text_config(size, tokenizer, model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    vision = dict(hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                  num_hidden_layers=size.vision_depth, num_attention_heads=size.vision_heads,
                  image_size=fixed_image_side(size), patch_size=PATCH_SIZE)
    return transformers.Idefics3Config(
        text_config=text, vision_config=vision, image_token_id=token_ids(tokenizer, "<image>")[0], scale_factor=2,
        tie_word_embeddings=False, architectures=["Idefics3ForConditionalGeneration"],
    )


def _tiny_image_processor(size: SizeSpec):
    # Images up to two tiles a side: a 2x2 split plus the global tile at most.
    tile = fixed_image_side(size)
    cls = getattr(transformers, "Idefics3ImageProcessorPil", None) or transformers.Idefics3ImageProcessor
    return cls(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}, do_image_splitting=True,
               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


register(Family(
    model_type="idefics3",
    adapter=_idefics3_adapter,
    image_rules={"Idefics3Processor": SplitImages},
    # vLLM keeps transformers' module paths (model.vision_model, model.connector, model.text_model,
    # lm_head); its Idefics2 vision attention fuses q/k/v like the Llama decoder.
    vllm=VLLMNames(prefixes=((r"^model\.", "model."), (r"^lm_head\.", "lm_head.")),
                   stacking_scopes=("model.text_model.layers.", "model.vision_model.encoder.layers."),
                   embed_tokens="model.text_model.embed_tokens.weight", vision_transformer="model.vision_model."),
    tiny=TinySpec(
        model_class="Idefics3ForConditionalGeneration", processor_class="Idefics3Processor", config=_tiny_config,
        image_processor=_tiny_image_processor,
        extra_tokens=(("<fake_token_around_image>", True), ("<image>", True), ("<global-img>", True),
                      ("<end_of_utterance>", True))
        + tuple((f"<row_{r}_col_{c}>", True) for r in range(1, 7) for c in range(1, 7)),
        image_part="<image>", end_of_turn="<end_of_utterance>",
        # tokens per tile: (tile / patch)² / scale_factor², scale_factor 2
        processor_fields=lambda size: {"image_seq_len": (fixed_image_side(size) // PATCH_SIZE) ** 2 // 4},
    ),
))
