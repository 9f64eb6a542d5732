"""Family adapters: everything model-family specific lives here and the rest asks the adapter.

An adapter knows a family's special token ids, how it computes position ids (Qwen-VL: 3-D
m-rope, per sequence from that sequence's own image grid), which submodules are the FSDP units,
and which tokens must never be sampled. Adding a family means one new adapter class and one row
in `ADAPTERS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FamilyAdapter:
    """Qwen2-VL / Qwen2.5-VL: m-rope positions, vision tower `model.visual`, decoder in `model.language_model`."""

    name: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    hf_architecture: str

    @property
    def pixel_factor(self) -> int:
        """Image sides must be multiples of this many pixels (patch × merge)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def banned_token_ids(self) -> list[int]:
        """Tokens a response must never contain: sampling one breaks the next forward."""
        return [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        return int(grid_thw.prod()) // self.spatial_merge_size**2

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

    # --- module structure -------------------------------------------------------------------
    def vision_tower(self, model: nn.Module) -> nn.Module:
        return model.model.visual

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.language_model.layers)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.model.language_model.norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return model.model.language_model.embed_tokens

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


def _qwen_adapter(config, name: str, arch: str) -> FamilyAdapter:
    vc = config.vision_config
    return FamilyAdapter(
        name=name,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        spatial_merge_size=vc.spatial_merge_size,
        patch_size=vc.patch_size,
        temporal_patch_size=vc.temporal_patch_size,
        hf_architecture=arch,
    )


ADAPTERS = {
    "qwen2_vl": lambda cfg: _qwen_adapter(cfg, "qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": lambda cfg: _qwen_adapter(cfg, "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
}


def build_adapter(config) -> FamilyAdapter:
    """The adapter for a transformers config; an unsupported family names the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model family '{model_type}' is not supported; supported families: {', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type](config)
