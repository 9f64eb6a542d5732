"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: dynamic resolution, m-rope positions, one `<|image_pad|>` per merged patch.

Images keep their size (sides on the patch × merge grid, within the processor's pixel limits);
the processor cuts them into patch rows, and every 2×2 block of patches becomes one image token
(`image_tokens`). Positions are 3-D m-rope (temporal, height, width) next to the plain 1-D row.
Qwen3-VL adds DeepStack: features of a few vision blocks added to the decoder's hidden states
at the image positions. vLLM 0.26 keeps transformers' module paths under other prefixes and
stacks the decoder's q/k/v and gate/up (and Qwen2.5-VL's gated vision MLP).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from data.images import canonicalize_image, to_rgb
from data.processing import ImageRule, group_timestamps, size_field, video_metadata
from models.attention import given_grid, longest_of, prebuilt_masks, remember_bounds
from models.families.tiny import (
    IMAGE_MEAN, IMAGE_STD, MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, SizeSpec, TinySpec, text_config, token_ids,
)
from models.family import Family, FamilyAdapter, ToolFormat, VLLMNames, register


def grid_seconds(temporal_patch_size: int, fps: float) -> float:
    """Seconds per temporal group of a clip sampled at `fps` (transformers' Qwen2.5-VL processor: temporal
    patch / sampled fps), rounded to a bfloat16 value. vLLM 0.26 casts every floating output of the
    processor to the engine's dtype (`InputProcessingContext._postprocess_output`) before its m-rope
    positions read `second_per_grid_ts`: a bf16 engine at, say, 3 fps (2/3 s, 0.66796875 in bf16) or
    at a thinned clip's rate would space the groups otherwise than the fp32 value does. A bf16 value is
    exact in fp16 and fp32 too, so every engine dtype and the trainer read the same number."""
    return float(torch.tensor(temporal_patch_size / fps, dtype=torch.float32).to(torch.bfloat16))


def image_tokens(grid_thw, merge_size: int) -> int:
    """Placeholder tokens of one image of patch grid (t, h, w): one per merge × merge patches."""
    return int(torch.as_tensor(grid_thw).prod()) // merge_size**2


class QwenImages(ImageRule):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: dynamic resolution, one `<|image_pad|>` per merged patch.

    Images are re-fit (a no-op for canonical ones) to multiples of patch × merge, the family's
    grid (28 for Qwen2/2.5-VL, 32 for Qwen3-VL), within the image processor's pixel limits.
    pixel_values: (patches, dim); image_grid_thw: the (t, h, w) patch grid per image.
    """

    placeholder = "<|image_pad|>"

    def __init__(self, image_processor, config: dict):
        self.image_processor = image_processor
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.factor = int(getattr(image_processor, "patch_size", 14)) * self.merge_size
        size = getattr(image_processor, "size", None)
        self.min_pixels = int(getattr(image_processor, "min_pixels", None) or size_field(size, "shortest_edge") or self.factor**2)
        self.max_pixels = int(getattr(image_processor, "max_pixels", None) or size_field(size, "longest_edge") or 1 << 24)

    def prepare(self, image):
        if image.width % self.factor == 0 and image.height % self.factor == 0:
            return to_rgb(image)
        top = max(self.max_pixels, image.width * image.height, self.factor**2)
        return canonicalize_image(image, min_pixels=min(self.min_pixels, top), max_pixels=top, factor=self.factor)

    def encode(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.image_processor(images=images, do_resize=False, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def expansion(self, grid_row: torch.Tensor) -> str:
        return self.placeholder * image_tokens(grid_row, self.merge_size)

    # --- videos: the family's video processor's arithmetic, computed here (it needs torchvision);
    # taken where a subclass names the placeholder (GLM-4.1V's rule, built on this one, takes none) ---

    @property
    def temporal_patch_size(self) -> int:
        return int(getattr(self.image_processor, "temporal_patch_size", 2))

    @property
    def video_factor(self) -> int:
        return self.factor

    @property
    def frame_multiple(self) -> int:
        return self.temporal_patch_size

    def encode_videos(self, videos: list) -> dict:
        """Patch rows of each clip exactly as `Qwen2VLVideoProcessor` / `Qwen3VLVideoProcessor` make
        them with `do_resize=False`: rescale and normalize fused in fp32, then `temporal_patch_size`
        consecutive frames per patch, rows in merge order. Frames are not resized: a clip whose
        sides are off the family's grid is an error, not a silent resize."""
        pixels, grids, seconds = [], [], []
        for v in videos:
            rows, grid = self.video_patches(v.frames)
            pixels.append(rows)
            grids.append(grid)
            seconds.append(grid_seconds(self.temporal_patch_size, video_metadata(v)["fps"]))
        return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids),
                "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}

    def video_patches(self, frames: list) -> tuple[torch.Tensor, list[int]]:
        """(rows (t·h·w, 3·temporal·patch²), [t, h, w]) of one clip's frames."""
        import numpy as np

        ip = self.image_processor
        patch, merge, temporal = int(ip.patch_size), self.merge_size, self.temporal_patch_size
        width, height = frames[0].size
        if width % self.factor or height % self.factor or any(f.size != (width, height) for f in frames):
            raise ValueError(f"video frames must share one size with sides multiples of {self.factor}; "
                             f"got {sorted({f.size for f in frames})}")
        video = torch.from_numpy(np.stack([np.asarray(to_rgb(f)) for f in frames])).permute(0, 3, 1, 2)
        if pad := -video.shape[0] % temporal:  # the processor repeats the last frame
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        video = video.to(torch.float32)
        if ip.do_rescale and ip.do_normalize:  # fused, as transformers' torchvision backend does it
            mean = torch.tensor(ip.image_mean) * (1.0 / ip.rescale_factor)
            std = torch.tensor(ip.image_std) * (1.0 / ip.rescale_factor)
            video = (video - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        elif ip.do_rescale:
            video = video * ip.rescale_factor
        elif ip.do_normalize:
            video = (video - torch.tensor(ip.image_mean).view(-1, 1, 1)) / torch.tensor(ip.image_std).view(-1, 1, 1)
        frames_n, channel = video.shape[:2]
        t, h, w = frames_n // temporal, height // patch, width // patch
        rows = video.view(t, temporal, channel, h // merge, merge, patch, w // merge, merge, patch)
        rows = rows.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, channel * temporal * patch * patch)
        return rows.contiguous(), [t, h, w]



class Qwen2Images(QwenImages):
    """Qwen2-VL / Qwen2.5-VL: Qwen images, and videos whose placeholder expands to one
    `<|video_pad|>` per merged patch of every temporal group."""

    video_placeholder = "<|video_pad|>"

    def video_expansion(self, grid_row: torch.Tensor, video) -> str:
        return self.video_placeholder * image_tokens(grid_row, self.merge_size)


class Qwen3Images(Qwen2Images):
    """Qwen3-VL / Qwen3.5: Qwen images; a video's placeholder expands, per temporal group, to its
    time as text (`<0.5 seconds>`), then `<|vision_start|>`, that group's `<|video_pad|>`s and
    `<|vision_end|>` (transformers' `Qwen3VLProcessor.replace_video_token`, vLLM's `get_video_repl`),
    the times from `video_metadata` as both compute them."""

    def video_expansion(self, grid_row: torch.Tensor, video) -> str:
        t, h, w = (int(x) for x in grid_row)
        per_group = self.video_placeholder * (h * w // self.merge_size**2)
        times = group_timestamps(video_metadata(video), self.temporal_patch_size)
        if len(times) != t:
            raise ValueError(f"{len(times)} timestamps for {t} temporal groups ({video.source})")
        return "".join(f"<{sec:.1f} seconds><|vision_start|>{per_group}<|vision_end|>" for sec in times)



# Tool calls as Qwen2/2.5-VL write them (Hermes style, the tokenizer's <tool_call> tokens); a tool's
# answer comes back as a user turn wrapped in <tool_response>, images first, as DeepEyes does.
# The schemas go into the system turn as Qwen2.5's and Qwen3-VL's templates write them for `tools=`
# (used when a checkpoint's template does not take `tools=`, as Qwen2-VL's does not).
QWEN_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>")
QWEN_TOOLS = ToolFormat(call_start="<tool_call>", call_end="</tool_call>", result_role="user",
                        result_prefix="<tool_response>", result_suffix="</tool_response>",
                        tools_intro=QWEN_TOOLS_INTRO, tools_outro=QWEN_TOOLS_OUTRO,
                        default_system="You are a helpful assistant.")
# Qwen3-VL's chat template has a `tool` role and wraps its content in <tool_response> itself.
QWEN3_TOOLS = ToolFormat(call_start="<tool_call>", call_end="</tool_call>", result_role="tool",
                         tools_intro=QWEN_TOOLS_INTRO, tools_outro=QWEN_TOOLS_OUTRO)


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
    varlen_vision: bool = True  # every Qwen-VL tower (and GLM-4.1V's) takes its boundaries as cu_seqlens
    vision_in_tower: bool = True  # `_run_tower`: model.visual with its merger (and Qwen3-VL's deepstack mergers)
    shares_prompts: bool = True  # tests/test_shared_prompts.py
    # the decoder takes its masks prebuilt, one per layer type (`run_language_model`; GLM-4.1V's builds its own
    # whatever it is given)
    takes_prebuilt_masks: bool = True
    end_of_turn: str = "<|im_end|>"  # ChatML
    tool_format: ToolFormat | None = QWEN_TOOLS
    video_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    spatial_merge_size: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    # Qwen2.5-VL: m-rope positions per second of video (vision_config.tokens_per_second); None: the
    # family spaces temporal groups one position apart (Qwen2-VL) or splits them (Qwen3-VL).
    tokens_per_second: float | None = None

    @property
    def pixel_factor(self) -> int:
        """Image sides must be multiples of this many pixels (patch × merge)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def banned_token_ids(self) -> list[int]:
        return [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        return image_tokens(grid_thw, self.spatial_merge_size)

    def pixel_rows(self, grid: torch.Tensor) -> int:
        return int(grid.prod(dim=-1).sum())

    def dummy_vision_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        grid = torch.tensor([[1, self.spatial_merge_size, self.spatial_merge_size]])
        pixels = torch.zeros(int(grid.prod()), 3 * self.temporal_patch_size * self.patch_size**2)
        return pixels.to(device), grid.to(device)

    def image_features(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        out = self._run_tower(model, pixels, grid)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(feats, (tuple, list)):
            feats = torch.cat(list(feats))
        return [feats]

    def _run_tower(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor):
        """The vision tower's output, its grid-derived inputs precomputed where it takes them (`_vision_layout`)."""
        tower = self.vision_tower(model)
        return tower(pixels, grid_thw=grid, **self._vision_layout(tower, grid))

    def _vision_layout(self, tower: nn.Module, grid: torch.Tensor) -> dict:
        """What the Qwen-VL towers (Qwen2/2.5/3-VL, Qwen3.5, GLM-4.1V) compute from the patch grid before their
        blocks (rotary positions, the images' and the windows' boundaries and longest spans, the window order, the
        learned position table's interpolation), computed by transformers' own functions from the host's copy of
        the grid (`models.attention.given_grid`), as the keyword arguments the tower takes them precomputed by.
        From the device's grid the tower reads the grid back several times per forward. Empty without the host's
        grid, or with a transformers whose tower takes none."""
        from transformers import vision_utils

        rows = given_grid(grid.shape[0])
        takes = _precomputed_inputs(type(tower))
        if rows is None or "cu_seqlens" not in takes:
            return {}
        host = torch.tensor(rows, dtype=grid.dtype)
        parts = {"position_ids": vision_utils.get_vision_position_ids(host, tower.spatial_merge_size),
                 "cu_seqlens": vision_utils.get_vision_cu_seqlens(host)}
        if "cu_window_seqlens" in takes:
            parts["window_index"], parts["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                host, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
                patch_size=tower.patch_size)
        if "interp_indices" in takes:  # Qwen3-VL, Qwen3.5: the position table resampled to each image's grid
            interpolation = vision_utils.get_vision_interpolation_indices_and_weights(
                host, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
            parts["interp_indices"], parts["interp_weights"] = interpolation
        longest = {"cu_seqlens": "max_seqlen", "cu_window_seqlens": "max_window_seqlen"}
        bounds = {name: parts[name].tolist() for name in longest if name in parts}
        # from ordinary host memory: the copies do not wait for the device's queue
        layout = {name: t.to(grid.device, non_blocking=True) for name, t in parts.items()}
        for name, values in bounds.items():
            remember_bounds(layout[name], values)  # where the vision attention reads them
            layout[longest[name]] = longest_of(values)
        return layout

    def video_segments(self, video_grid_thw: torch.Tensor | None, second_per_grid_ts: torch.Tensor | None) -> list:
        """(t, h, w, temporal step) of each placeholder run the videos take, in order.

        Qwen2.5-VL: one run per video, temporal groups `second_per_grid_ts · tokens_per_second`
        positions apart (vLLM 0.26's `iter_mm_grid_thw`: the fp32 seconds as a Python float times
        the config's tokens per second, floored per group). Without `tokens_per_second` (Qwen2-VL) the
        step is 1.
        """
        if video_grid_thw is None:
            return []
        grids = video_grid_thw.reshape(-1, 3).tolist()
        if self.tokens_per_second is None:
            return [(t, h, w, 1.0) for t, h, w in grids]
        if second_per_grid_ts is None or second_per_grid_ts.numel() != len(grids):
            raise ValueError(f"{len(grids)} videos need {len(grids)} second_per_grid_ts values, got "
                             f"{None if second_per_grid_ts is None else second_per_grid_ts.numel()}")
        seconds = second_per_grid_ts.reshape(-1).to(torch.float32).tolist()
        return [(t, h, w, sec * self.tokens_per_second) for (t, h, w), sec in zip(grids, seconds)]

    def position_ids(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """(4, L) positions of one sequence: row 0 the plain 1-D positions, rows 1–3 m-rope (t, h, w).

        Text runs advance all three m-rope rows together; an image or video run of merged grid
        (t, h, w) takes positions start + (⌊t_i · step⌋, h_i, w_i), and the text after it resumes one
        past the largest position the run took (vLLM 0.26's `get_mrope_input_positions`, and
        transformers' before 5.0; transformers 5.x resumes at start + max(h, w), which differs only
        after a video whose temporal extent passes its spatial one). Row 0 lets attention see
        sequence boundaries when sequences are packed into one row.
        """
        self.check_videos(video_grid_thw)
        ids = input_ids.tolist()
        n = len(ids)
        rope = torch.empty(3, n, dtype=torch.long)
        runs = {self.image_token_id: [(t, h, w, 1.0) for t, h, w in
                                      ([] if image_grid_thw is None else image_grid_thw.reshape(-1, 3).tolist())],
                self.video_token_id: self.video_segments(video_grid_thw, second_per_grid_ts)}
        used = dict.fromkeys(runs, 0)
        pos, i = 0, 0
        while i < n:
            if ids[i] not in runs:
                j = i
                while j < n and ids[j] not in runs:
                    j += 1
                rope[:, i:j] = torch.arange(pos, pos + j - i)
                pos += j - i
                i = j
                continue
            token, k = ids[i], used[ids[i]]
            kind = "image" if token == self.image_token_id else "video"
            if k >= len(runs[token]):
                raise ValueError(f"sequence has more {kind} placeholder runs than {kind}s ({len(runs[token])})")
            t, h, w, step = runs[token][k]
            h, w = h // self.spatial_merge_size, w // self.spatial_merge_size
            count = t * h * w
            if ids[i : i + count] != [token] * count:
                raise ValueError(f"{kind} {k} needs {count} placeholder tokens at position {i}; the sequence has fewer")
            temporal = [int(g * step) for g in range(t)]
            grid = torch.stack(torch.meshgrid(torch.tensor(temporal), torch.arange(h), torch.arange(w),
                                              indexing="ij")).reshape(3, -1)
            rope[:, i : i + count] = grid + pos
            pos += max(temporal[-1], h - 1, w - 1) + 1
            i += count
            used[token] += 1
        for token, kind in ((self.image_token_id, "image"), (self.video_token_id, "video")):
            if used[token] != len(runs[token]):
                raise ValueError(f"sequence has {used[token]} {kind} placeholder runs but {len(runs[token])} {kind}s")
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
        lm = self.language_model(model)
        # Qwen2/2.5-VL's decoder takes its masks prebuilt, one per layer type: where the varlen kernel runs it
        # reads none, and building them would first read the positions back from the device
        masks = prebuilt_masks(lm.config, embeds.device) if self.takes_prebuilt_masks else None
        out = lm(inputs_embeds=embeds, position_ids=position_ids, attention_mask=masks, use_cache=False)
        return out.last_hidden_state

    def engine_inputs(self, input_ids, positions, attention_mask, pixels, grid):
        kwargs = dict(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask)
        if pixels is not None:
            kwargs.update(pixel_values=pixels, image_grid_thw=grid)
        return kwargs

    def video_engine_inputs(self, pixels, grid, seconds):
        # Positions are given explicitly, so the model's own rope index (and `second_per_grid_ts`
        # in it) is not used; the forward takes it all the same.
        kwargs = dict(pixel_values_videos=pixels, video_grid_thw=grid)
        if seconds is not None and self.tokens_per_second is not None:
            kwargs["second_per_grid_ts"] = seconds
        return kwargs

    def vllm_processor_kwargs(self, min_pixels: int, max_pixels: int) -> dict:
        # Images arrive with sides on the patch × merge grid within these limits; the trainer's
        # processor is told not to resize them, and so is vLLM's (Qwen2VLImageProcessor.size).
        # `do_resize` reaches the video processor too: frames keep their canonical size.
        return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}, "do_resize": False}

    def vllm_collapse_videos(self, ids: list[int]) -> tuple[list[int], list[list[int]]]:
        """Qwen2/2.5-VL: vLLM's `PromptReplacement` targets one `<|video_pad|>` and inserts the video's
        whole run of it, so each run becomes one token."""
        out: list[int] = []
        runs: list[list[int]] = []
        for token in ids:
            if token == self.video_token_id and out and out[-1] == token:
                runs[-1].append(token)
                continue
            out.append(token)
            if token == self.video_token_id:
                runs.append([token])
        return out, runs

    def vllm_video_items(self, videos: list) -> tuple[list, dict]:
        """Frames as (T, H, W, 3) uint8 arrays. vLLM 0.26's Qwen2/2.5-VL parser drops a video's own
        metadata, and transformers' Qwen2.5-VL processor reads `second_per_grid_ts` from it (without
        it: 24 fps), so the metadata goes as the request's `video_metadata` processor argument. Its
        `fps` is temporal patch / `grid_seconds`, so that transformers' temporal patch / fps gives the
        trainer's bf16-exact seconds back (Qwen2.5-VL reads nothing else of the timing)."""
        import numpy as np

        arrays = [np.stack([np.asarray(f) for f in v.frames]) for v in videos]
        metas = []
        for v in videos:
            meta = {k: val for k, val in video_metadata(v).items() if k != "do_sample_frames"}
            meta["fps"] = self.temporal_patch_size / grid_seconds(self.temporal_patch_size, meta["fps"])
            metas.append(meta)
        return arrays, {"video_metadata": metas}

    def vllm_processor_cache_safe(self, max_videos_per_prompt: int) -> bool:
        """Not with two or more videos. vLLM 0.26's processor cache keys an item by its content and the
        request's processor kwargs, and on a partial hit (prompt [a, c] after [a, b], the clips' metadata
        equal; or one of a prompt's clips evicted) hands transformers only the missed clips, with the
        request's `video_metadata` whole: transformers 5.17's Qwen2.5-VL processor then refuses the call
        (fps for 2 clips, grids for 1), and later versions refuse it earlier. The timing has no per-item
        route here (the parser drops an item's own metadata), so such engines run without the cache
        (tools/vllm_prompt_check.py's `video_cache` check replays the case through vLLM's processor)."""
        return max_videos_per_prompt < 2


@dataclass
class Qwen3VLAdapter(QwenVLAdapter):
    """Qwen3-VL: Qwen-VL positions and inputs, plus DeepStack.

    The vision tower also returns features of a few intermediate blocks (one stream per
    deepstack level, aligned with the image tokens); the decoder adds level k to the hidden
    states at the image positions after its k-th layer. Position ids are Qwen2-VL's for images
    (interleaved m-rope sections are the rotary embedding's business, not the ids').
    """

    varlen_attention: bool = False  # not yet checked on a GPU
    shares_prompts: bool = True  # DeepStack included: tests/test_shared_prompts.py
    tool_format: ToolFormat | None = QWEN3_TOOLS

    def vllm_collapse_videos(self, ids: list[int]) -> tuple[list[int], list[list[int]]]:
        """Qwen3-VL: the template writes `<|vision_start|><|video_pad|><|vision_end|>` and both transformers
        and vLLM replace its `<|video_pad|>` with every temporal group's `<t seconds><|vision_start|>`,
        pads and `<|vision_end|>`: that whole span (between the template's start and end) collapses."""
        start, end, pad = self.vision_start_token_id, self.vision_end_token_id, self.video_token_id
        out: list[int] = []
        blocks: list[list[int]] = []
        i, n = 0, len(ids)
        while i < n:
            if ids[i] != start or i + 1 >= n or ids[i + 1] in (pad, self.image_token_id, end, start):
                out.append(ids[i])
                i += 1
                continue
            j = i + 1  # the first group's timestamp text
            while True:
                k = ids.index(start, j) if start in ids[j:] else -1
                if k < 0 or k + 1 >= n or ids[k + 1] != pad:
                    raise ValueError(f"a video span at position {i} has no <|vision_start|><|video_pad|> group")
                m = k + 1
                while m < n and ids[m] == pad:
                    m += 1
                if m >= n or ids[m] != end:
                    raise ValueError(f"a video group at position {k} does not end with <|vision_end|>")
                j = m + 1
                if j < n and ids[j] == end:
                    break
            out += [start, pad]
            blocks.append(ids[i + 1 : j])
            i = j
        return out, blocks

    def vllm_video_items(self, videos: list) -> tuple[list, dict]:
        """(frames as a (T, H, W, 3) uint8 array, the clip's metadata) per video: vLLM 0.26's Qwen3-VL
        processor computes the timestamps from `frames_indices` and `fps` as `video_metadata` says."""
        import numpy as np

        from data.processing import video_metadata

        return [(np.stack([np.asarray(f) for f in v.frames]), video_metadata(v)) for v in videos], {}

    def vllm_processor_cache_safe(self, max_videos_per_prompt: int) -> bool:
        # each item carries its own metadata, so a missed clip is processed with its own timing
        return True

    def video_segments(self, video_grid_thw, second_per_grid_ts):
        """One run per temporal group, each like a one-frame image: the groups are separated by their
        timestamp text (transformers' and vLLM's Qwen3-VL positions split `video_grid_thw` the same way)."""
        if video_grid_thw is None:
            return []
        return [(1, h, w, 1.0) for t, h, w in video_grid_thw.reshape(-1, 3).tolist() for _ in range(t)]

    def image_features(self, model, pixels, grid):
        out = self._run_tower(model, pixels, grid)
        return [out.pooler_output, *getattr(out, "deepstack_features", ())]  # Qwen3.5's tower has none

    def run_language_model(self, model, embeds, position_ids, image_mask, extra_streams):
        decoder = self.language_model(model)
        kwargs = {}
        if extra_streams:
            where = image_mask
            if image_mask.shape[0] == 1 and apply_indexed_deepstack(decoder):
                # the vision positions as indices, found without reading the mask back: their count is the
                # streams' length, known on the host
                where = torch.nonzero_static(image_mask[0], size=extra_streams[0].shape[0]).squeeze(1)
            kwargs = dict(visual_pos_masks=where, deepstack_visual_embeds=list(extra_streams))
        out = decoder(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **kwargs)
        return out.last_hidden_state


def apply_indexed_deepstack(decoder: nn.Module) -> bool:
    """Let the decoder's DeepStack step (transformers' `_deepstack_process`, once per level) take the vision
    positions as a (N,) index as well as a boolean mask (in place, once). Indexing by a mask reads its count
    back from the device, twice per level; the sums are the same. False where the decoder has no such step."""
    if getattr(decoder, "_vlrl_indexed_deepstack", False):
        return True
    by_mask = getattr(type(decoder), "_deepstack_process", None)
    if by_mask is None:
        return False

    def process(hidden_states, visual_pos_masks, visual_embeds):
        if visual_pos_masks.dtype == torch.bool:
            return by_mask(decoder, hidden_states, visual_pos_masks, visual_embeds)
        at = visual_pos_masks.to(hidden_states.device)
        hidden_states = hidden_states.clone()
        hidden_states[:, at] = hidden_states[:, at] + visual_embeds.to(hidden_states.device, hidden_states.dtype)
        return hidden_states

    decoder._deepstack_process = process
    decoder._vlrl_indexed_deepstack = True
    return True


@functools.cache
def _precomputed_inputs(tower_class: type) -> frozenset[str]:
    """The grid-derived inputs a vision tower of this class takes precomputed: those of the
    `transformers.vision_utils` functions its transformers module calls (each takes its value from the
    forward's keyword arguments). Looked up once per class."""
    for cls in tower_class.__mro__:
        if cls.__module__.startswith("transformers.models."):
            module = sys.modules.get(cls.__module__)
            takes = set()
            if hasattr(module, "get_vision_attention_seqlens") and hasattr(module, "get_vision_position_ids"):
                takes |= {"position_ids", "cu_seqlens", "max_seqlen"}
            if hasattr(module, "get_vision_window_index") and hasattr(module, "get_max_seqlen"):
                takes |= {"window_index", "cu_window_seqlens", "max_window_seqlen"}
            if hasattr(module, "get_vision_interpolation_indices_and_weights"):
                takes |= {"interp_indices", "interp_weights"}
            return frozenset(takes)
    return frozenset()


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
        tokens_per_second=getattr(vc, "tokens_per_second", None) if config.model_type == "qwen2_5_vl" else None,
        takes_video=True,
    )


# --- vLLM ---------------------------------------------------------------------------------------
# transformers 5 names the decoder `model.language_model.*` and the tower `model.visual.*`;
# checkpoint files use the hub layout `model.*`, `visual.*`, `lm_head.*`. vLLM 0.26
# (`Qwen2VLForConditionalGeneration.hf_to_vllm_mapper` and its 2.5/3 siblings) puts the decoder
# under `language_model.model.` and the head under `language_model.lm_head.`.
_PREFIXES = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^model\.visual\.", "visual."),
    (r"^model\.", "language_model.model."),
    (r"^visual\.", "visual."),
    (r"^lm_head\.", "language_model.lm_head."),
)
# Qwen2-VL's and Qwen3-VL's vision MLPs are fc1/fc2 (nothing to stack); Qwen2.5-VL's is gated and
# vLLM fuses its gate/up like the decoder's. The towers keep the checkpoint's fused attn.qkv.
_DECODER = ("language_model.model.layers.",)


# --- tiny checkpoints ---------------------------------------------------------------------------
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
QWEN3_PATCH_SIZE = 16  # Qwen3-VL: 16-pixel patches, a 32-pixel grid


def _vision_config(model_type: str, size: SizeSpec) -> dict:
    common = dict(depth=size.vision_depth, num_heads=size.vision_heads, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE)
    if model_type == "qwen2_vl":
        # Qwen2-VL: embed_dim is the tower's width, hidden_size the merger's output.
        return dict(common, embed_dim=size.vision_hidden, hidden_size=size.text_hidden,
                    mlp_ratio=size.vision_mlp_ratio)
    if model_type == "qwen3_vl":
        # DeepStack levels at 1/4, 1/2 and 3/4 of the depth (the 8B model: blocks 8, 16, 24 of 27),
        # a learned 8x8 position table interpolated to each image's grid.
        depth = size.vision_depth
        deepstack = sorted({min(depth - 1, depth * k // 4) for k in (1, 2, 3)})
        return dict(common, patch_size=QWEN3_PATCH_SIZE, hidden_size=size.vision_hidden,
                    intermediate_size=size.vision_intermediate, out_hidden_size=size.text_hidden,
                    num_position_embeddings=64, deepstack_visual_indexes=deepstack)
    return dict(common, hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
                out_hidden_size=size.text_hidden, window_size=size.window_size,
                fullatt_block_indexes=list(size.fullatt_blocks), tokens_per_second=2)


def _tiny_config(model_type: str, config_class: str, model_class: str):
    def build(size: SizeSpec, tokenizer):
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(size.mrope_section)}
        if model_type == "qwen3_vl":
            rope.update(rope_theta=5000000.0, mrope_interleaved=True)
            text = text_config(size, tokenizer, rope_parameters=rope, head_dim=size.text_hidden // size.text_heads)
        else:
            text = text_config(size, tokenizer, rope_parameters=rope, max_window_layers=size.text_layers,
                               use_sliding_window=False)
        image, video, start, end = token_ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                             "<|vision_end|>")
        return getattr(transformers, config_class)(
            text_config=text, vision_config=_vision_config(model_type, size), image_token_id=image,
            video_token_id=video, vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
            architectures=[model_class],
        )
    return build


def _tiny_image_processor(model_type: str):
    """Qwen2-VL's image processor with the size's pixel limits; Qwen3-VL's grid is 32 pixels, not 28,
    so its limits are the size's scaled by (32/28)²."""
    def build(size: SizeSpec):
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
        if model_type == "qwen3_vl":
            scale = (QWEN3_PATCH_SIZE * MERGE_SIZE) ** 2 / (PATCH_SIZE * MERGE_SIZE) ** 2
            return cls(min_pixels=int(size.min_pixels * scale), max_pixels=int(size.max_pixels * scale),
                       patch_size=QWEN3_PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        return cls(min_pixels=size.min_pixels, max_pixels=size.max_pixels, patch_size=PATCH_SIZE,
                   temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE,
                   image_mean=list(IMAGE_MEAN), image_std=list(IMAGE_STD))
    return build


def _family(model_type: str, prefix: str, cls=QwenVLAdapter, extra_tokens=(), stacking=_DECODER) -> Family:
    model_class = f"{prefix}ForConditionalGeneration"
    return Family(
        model_type=model_type,
        adapter=lambda config: _qwen_adapter(config, model_type, model_class, cls),
        image_rules={f"{prefix}Processor": Qwen3Images if issubclass(cls, Qwen3VLAdapter) else Qwen2Images},
        vllm=VLLMNames(prefixes=_PREFIXES, stacking_scopes=stacking),
        tool_format=cls.tool_format,
        tiny=TinySpec(model_class=model_class, processor_class=f"{prefix}Processor",
                      config=_tiny_config(model_type, f"{prefix}Config", model_class),
                      image_processor=_tiny_image_processor(model_type), extra_tokens=extra_tokens),
    )


register(_family("qwen2_vl", "Qwen2VL"))
register(_family("qwen2_5_vl", "Qwen2_5_VL", extra_tokens=QWEN2_5_EXTRA_TOKENS,
                 stacking=(*_DECODER, "visual.blocks.")))
# Qwen3-VL: learned position embeddings interpolated to the image's grid, DeepStack features from a
# few vision blocks, interleaved m-rope.
register(_family("qwen3_vl", "Qwen3VL", Qwen3VLAdapter,
                 extra_tokens=QWEN2_5_EXTRA_TOKENS + (("<think>", False), ("</think>", False))))
