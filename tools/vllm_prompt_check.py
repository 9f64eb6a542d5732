"""Run vLLM's own multimodal processor on the trainer's prompts, without a GPU.

For one model folder it builds vLLM's `ModelConfig` and multimodal processor the way `vllm.LLM`
does (the family's `vllm_processor_kwargs`, a per-prompt image limit) and checks:

  startup   vLLM's start-up dummy inputs for images (`MultiModalBudget` → `get_dummy_mm_inputs`,
            the path where SmolVLM's engine once failed to start), at 1 and at the limit of images;
  prompt    for trainer prompts with 1 and 2 images of different shapes (`encode_prompt`), the
            adapter's collapsed ids + the trainer's images through the processor's `apply`: its
            prompt ids must equal the trainer's expanded ids, its pixel values the trainer's
            `pixel_values`, and its placeholder ranges must cover exactly the image tokens.
  video     for families that take video, prompts with a clip at 1 and at 4 fps and one with an
            image and a clip: the adapter's collapsed ids + the trainer's frames and metadata
            (`vllm_video_items`, the request's processor kwargs included) through `apply`: prompt
            ids equal the trainer's (Qwen3-VL: its timestamp text), `pixel_values_videos`,
            `video_grid_thw` and `second_per_grid_ts` equal the trainer's, and the placeholder
            ranges cover exactly the video tokens.
  video_cache  two-video prompts [a, b], [a, c], [c, a] of equal metadata through one processor
            with the processor cache the engine gives vLLM ([a, c] is a partial hit where it is on):
            ids and `second_per_grid_ts` equal the trainer's (`--video-cache-gb` forces a size).
  video_seconds_bf16  a clip at 0.9 fps through a bfloat16 processor (vLLM casts the processor's
            floating outputs to the engine dtype): Qwen2.5-VL's `second_per_grid_ts` equals the trainer's.

One JSON line per check on stdout; the exit status is 1 if any check failed.

    python tools/vllm_prompt_check.py --family idefics3 --model /tmp/vcpu/idefics3

It needs an environment where vLLM's processing code imports (vLLM, its pure-Python dependencies,
transformers, torchvision). For a CPU machine without vLLM's compiled extensions, `_patch_vllm`
patches two things in this process only (vLLM's files are not touched): vLLM inspects a model
class in a subprocess, which is replaced by an in-process call; and the engine's own
`vllm_compat` shim for LLaVA (vLLM 0.26's pixtral.py, which llava.py imports, names two
transformers functions that transformers 5.17 removed; they get placeholders that raise if used);
and, on transformers newer than 5.17, the one input check that refuses vLLM's Qwen3-VL text call
(`_lenient_video_token_check`).
`vllm._C` is left missing: vLLM only warns about it. Importing this file needs no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = [(84, 56), (56, 112), (56, 56)]  # (width, height): different shapes, different tile grids
MIN_PIXELS, MAX_PIXELS = 3136, 12544


def _patch_vllm(family: str) -> list[str]:
    """Make vLLM's processing code import and run in this process; returns what was patched."""
    from rollout.vllm_engine import vllm_compat

    # LLaVA's module imports what transformers 5.17 removed (and mistral_common): only for LLaVA
    patched = vllm_compat(family)
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()  # the subprocess would not see the patches above
    patched.append("model inspection in-process")
    patched += _lenient_video_token_check()
    return patched


def _lenient_video_token_check() -> list[str]:
    """vLLM 0.26's Qwen3-VL processor runs a clip through transformers in a call of its own and then
    calls it on text that still holds `<|video_pad|>` without the clip; transformers 5.17 (vLLM's, the
    GPU image's) accepts that, later versions' `validate_inputs` refuse it. Let that one refusal pass."""
    from transformers import processing_utils

    original = processing_utils.ProcessorMixin.validate_inputs
    if getattr(original, "_vlrl_lenient", False) or "no videos were passed" not in _source(original):
        return []

    def validate_inputs(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except ValueError as err:
            if "but no videos were passed" not in str(err):
                raise

    validate_inputs._vlrl_lenient = True
    processing_utils.ProcessorMixin.validate_inputs = validate_inputs
    return ["transformers validate_inputs: video tokens without videos (vLLM's Qwen3-VL text call)"]


def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def build_vllm_processor(model: str, kwargs: dict, max_images: int, max_model_len: int = 4096, max_videos: int = 0,
                         hf_overrides=None):
    """vLLM's ModelConfig and multimodal processor for `model`, configured as the engine builds them
    (`hf_overrides`: the family's, from `FamilyAdapter.vllm_engine_kwargs`)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    # float32, so the pixels compare as the processor made them (the engine then casts to its dtype).
    config = ModelConfig(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=max_model_len,
                         mm_processor_kwargs=kwargs, mm_processor_cache_gb=0,
                         limit_mm_per_prompt={"image": max_images, "video": max_videos},
                         **({"hf_overrides": hf_overrides} if hf_overrides is not None else {}))
    return config, MULTIMODAL_REGISTRY.create_processor(config)


def check_startup(config, max_images: int) -> dict:
    """vLLM's start-up image profiling: the encoder budget, then dummy inputs at 1 and max images."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    out = {"check": "startup"}
    try:
        # The device only names where tensors go; the budget and the dummy inputs are CPU code.
        vllm_config = VllmConfig(model_config=config, device_config=DeviceConfig(device="cpu"))
        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY)
        out["max_tokens_per_image"] = dict(budget.mm_max_toks_per_item)
        for count in sorted({1, max_images}):
            dummy = MULTIMODAL_REGISTRY.get_dummy_mm_inputs(config, mm_counts={"image": count})
            ranges = dummy["mm_placeholders"]["image"]
            out[f"dummy_{count}"] = {"images": len(ranges), "placeholder_tokens": [r.length for r in ranges]}
        out["ok"] = True
    except Exception as err:  # noqa: BLE001 - the point is to report what vLLM raised
        out.update(ok=False, error=f"{type(err).__name__}: {err}"[:2000])
    return out


def _images(count: int):
    from PIL import Image

    return [Image.new("RGB", SIZES[i % len(SIZES)], (40 * i + 20, 200 - 30 * i, 30 + 50 * i)) for i in range(count)]


def _vllm_pixels(mm_kwargs, reference):
    """The pixel tensors of vLLM's per-image items, laid out as the trainer's one tensor."""
    import torch

    parts = []
    for item in mm_kwargs["image"]:
        data = item["pixel_values"].data
        parts.append(torch.cat(list(data)) if isinstance(data, (list, tuple)) else data)
    return torch.stack(parts) if parts[0].dim() == reference.dim() - 1 else torch.cat(parts)


def _compare_pixels(ours, theirs) -> dict:
    """Shapes, bitwise equality and the largest difference of the trainer's and vLLM's pixels."""
    import torch

    out = {"pixel_shape_trainer": list(ours.shape), "pixel_shape_vllm": list(theirs.shape)}
    if ours.shape != theirs.shape:
        return {**out, "pixels_equal": False}
    diff = (ours.double() - theirs.double()).abs().max().item()
    return {**out, "pixels_equal": ours.dtype == theirs.dtype and torch.equal(ours, theirs), "pixel_max_abs_diff": diff}


def _placeholders_cover(ids: list[int], ranges, blocks, image_id: int) -> tuple[bool, list]:
    """One range per image, and their embedding positions are exactly the image tokens of `ids`.

    `block_matches` (the range spans the adapter's block) is reported, not required: Gemma3's
    newline merging puts the text's own newlines into the block's first and last tokens.
    """
    covered: set[int] = set()
    found = []
    for r, block in zip(ranges, blocks):
        span = ids[r.offset : r.offset + r.length]
        embed = range(r.length) if r.is_embed is None else [i for i, e in enumerate(r.is_embed.tolist()) if e]
        covered.update(r.offset + i for i in embed)
        found.append({"offset": r.offset, "length": r.length, "embeds": len(embed), "block_matches": span == block})
    wanted = {i for i, t in enumerate(ids) if t == image_id}
    ok = len(ranges) == len(blocks) and covered == wanted
    return ok, found


def check_prompt(processor, config, trainer_processor, adapter, vocab, count: int, task: str) -> dict:
    """One trainer prompt with `count` images through vLLM's processor, compared with the trainer's."""
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt

    sample = Sample(0, _images(count), " and ".join(["<image>"] * count) + " How many objects?", "3")
    encoded = encode_prompt(trainer_processor, sample, task, config.max_model_len)
    ids = encoded.input_ids.tolist()
    out = {"check": f"prompt_{count}_images", "sizes": [im.size for im in encoded.images]}
    try:
        collapsed, blocks = adapter.vllm_collapse(ids, vocab)
        items = processor.info.parse_mm_data({"image": list(encoded.images)})
        result = processor.apply(ProcessorInputs(prompt=collapsed, mm_data_items=items),
                                 timing_ctx=TimingContext(enabled=False))
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    theirs = list(result["prompt_token_ids"])
    first = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    out.update(ids_equal=theirs == ids, trainer_len=len(ids), vllm_len=len(theirs))
    if theirs != ids:
        out.update(first_difference=first, trainer_near=ids[first : first + 8], vllm_near=theirs[first : first + 8])
    out.update(_compare_pixels(encoded.pixel_values, _vllm_pixels(result["mm_kwargs"], encoded.pixel_values)))
    ranges = result["mm_placeholders"].get("image", [])
    covered, ranges = _placeholders_cover(ids, ranges, blocks, adapter.image_token_id)
    out.update(placeholders_cover=covered, placeholders=ranges)
    out["ok"] = bool(out["ids_equal"] and out["pixels_equal"] and covered)
    return out


def _clips(side: int):
    """(problem, images, videos) of the video checks: frames on the family's grid, differing frame to frame."""
    from PIL import Image

    from data.video import Video

    def frames(n, w, h, seed):
        return [Image.new("RGB", (w, h), ((37 * i + seed * 50) % 256, 90 + 10 * seed, (200 - 20 * i) % 256))
                for i in range(n)]

    return [("<video>How many frames?", [], [Video(frames(8, 2 * side, side, 0), fps=1.0)]),
            ("<video>Which way?", [], [Video(frames(4, side, 2 * side, 1), fps=4.0)]),
            ("<image> and <video>: same?", [Image.new("RGB", (2 * side, 2 * side), (20, 200, 30))],
             [Video(frames(6, side, side, 2), fps=2.0)])]


def check_video_prompt(processor, config, trainer_processor, adapter, vocab, case: int, task: str) -> dict:
    """One trainer prompt with a video (and maybe an image) through vLLM's processor, compared with the trainer's."""
    import torch
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt

    problem, images, videos = _clips(trainer_processor.images.factor)[case]
    encoded = encode_prompt(trainer_processor, Sample(0, images, problem, "3", videos=videos), task,
                            config.max_model_len)
    ids = encoded.input_ids.tolist()
    out = {"check": f"video_{case}", "fps": [v.fps for v in videos], "frames": [len(v.frames) for v in videos]}
    try:
        collapsed, video_blocks = adapter.vllm_collapse_videos(ids)
        collapsed, image_blocks = adapter.vllm_collapse(collapsed, vocab)
        items, kwargs = adapter.vllm_video_items(list(encoded.videos))
        data = {"video": items, **({"image": list(encoded.images)} if encoded.images else {})}
        result = processor.apply(ProcessorInputs(prompt=collapsed, mm_data_items=processor.info.parse_mm_data(data),
                                                 hf_processor_mm_kwargs=kwargs),
                                 timing_ctx=TimingContext(enabled=False))
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    theirs = list(result["prompt_token_ids"])
    first = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    out.update(ids_equal=theirs == ids, trainer_len=len(ids), vllm_len=len(theirs))
    if theirs != ids:
        out.update(first_difference=first, trainer_near=trainer_processor.tokenizer.decode(ids[first:first + 12]),
                   vllm_near=trainer_processor.tokenizer.decode(theirs[first:first + 12]))
    video_items = result["mm_kwargs"]["video"]
    pixels = torch.cat([item["pixel_values_videos"].data for item in video_items])
    out.update(_compare_pixels(encoded.pixel_values_videos, pixels))
    grid = torch.stack([item["video_grid_thw"].data for item in video_items])
    out["grid_equal"] = grid.tolist() == encoded.video_grid_thw.tolist()
    if any("second_per_grid_ts" in item for item in video_items):
        seconds = [float(item["second_per_grid_ts"].data) for item in video_items]
        out.update(second_per_grid_ts_vllm=seconds, second_per_grid_ts_trainer=encoded.second_per_grid_ts.tolist())
        out["seconds_equal"] = seconds == encoded.second_per_grid_ts.tolist()
    ranges = result["mm_placeholders"].get("video", [])
    covered, ranges = _placeholders_cover(ids, ranges, video_blocks, adapter.video_token_id)
    out.update(placeholders_cover=covered, placeholders=ranges)
    out["ok"] = bool(out["ids_equal"] and out["pixels_equal"] and out["grid_equal"] and covered
                     and out.get("seconds_equal", True))
    return out


def _cache_clips(side: int):
    """Three clips of equal metadata (4 frames at 2 fps, one size) and different pixels."""
    from PIL import Image

    from data.video import Video

    return [Video([Image.new("RGB", (side, side), ((37 * i + 50 * k) % 256, 90 + 40 * k, 30)) for i in range(4)],
                  fps=2.0) for k in range(3)]


def check_video_cache(model: str, kwargs: dict, trainer_processor, adapter, task: str,
                      cache_gb: float | None = None) -> dict:
    """Two-video prompts [a, b], [a, c], [c, a] (equal metadata) through one vLLM processor with the
    processor cache the engine gives it (`rollout.vllm_engine.processor_cache` of 4 GiB for 2 videos;
    `cache_gb` forces a size): [a, c] is a partial hit where a cache is on. Each prompt's ids and
    `second_per_grid_ts` must equal the trainer's."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.cache import MultiModalProcessorOnlyCache
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt
    from rollout.vllm_engine import processor_cache

    gb = processor_cache(adapter, 4.0, 2) if cache_gb is None else cache_gb
    out = {"check": "video_cache", "processor_cache_gb": gb, "prompts": []}
    try:
        config = ModelConfig(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=4096,
                             mm_processor_kwargs=kwargs, mm_processor_cache_gb=gb,
                             limit_mm_per_prompt={"image": 1, "video": 2})
        cache = MultiModalProcessorOnlyCache(config) if gb > 0 else None
        processor = MULTIMODAL_REGISTRY.create_processor(config, cache=cache)
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    a, b, c = _cache_clips(trainer_processor.images.factor)
    for name, videos in (("ab", [a, b]), ("ac", [a, c]), ("ca", [c, a])):
        encoded = encode_prompt(trainer_processor, Sample(0, [], "<video> and <video>: same?", "1", videos=videos),
                                task, config.max_model_len)
        ids = encoded.input_ids.tolist()
        row = {"videos": name}
        try:
            collapsed, _ = adapter.vllm_collapse_videos(ids)
            items, request_kwargs = adapter.vllm_video_items(list(encoded.videos))
            result = processor.apply(ProcessorInputs(prompt=collapsed,
                                                     mm_data_items=processor.info.parse_mm_data({"video": items}),
                                                     hf_processor_mm_kwargs=request_kwargs),
                                     timing_ctx=TimingContext(enabled=False))
        except Exception as err:  # noqa: BLE001 - reported as this prompt's failure
            cause = f" (from {type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ else ""
            out["prompts"].append({**row, "ok": False, "error": f"{type(err).__name__}{cause}"[:600]})
            continue
        row["ids_equal"] = list(result["prompt_token_ids"]) == ids
        video_items = result["mm_kwargs"]["video"]
        if any("second_per_grid_ts" in item for item in video_items):
            seconds = [float(item["second_per_grid_ts"].data) for item in video_items]
            row["seconds_equal"] = seconds == encoded.second_per_grid_ts.tolist()
        row["ok"] = bool(row["ids_equal"] and row.get("seconds_equal", True))
        out["prompts"].append(row)
    out["ok"] = all(r["ok"] for r in out["prompts"])
    return out


def check_video_seconds(model: str, kwargs: dict, trainer_processor, adapter, task: str) -> dict:
    """A clip at 0.9 fps (16 temporal groups) through a bfloat16 processor, as a bf16 engine runs it:
    vLLM casts the processor's floating outputs to the engine dtype, so Qwen2.5-VL's
    `second_per_grid_ts` reaches its positions in bf16; it must equal the trainer's value."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    from data.datasets import Sample
    from data.processing import encode_prompt
    from data.video import Video

    side = trainer_processor.images.factor
    clip = Video([frame for k in range(32) for frame in _cache_clips(side)[0].frames[k % 4:k % 4 + 1]], fps=0.9)
    out = {"check": "video_seconds_bf16", "fps": clip.fps}
    try:
        config = ModelConfig(model=model, tokenizer=model, dtype="bfloat16", seed=0, max_model_len=4096,
                             mm_processor_kwargs=kwargs, mm_processor_cache_gb=0,
                             limit_mm_per_prompt={"image": 1, "video": 1})
        processor = MULTIMODAL_REGISTRY.create_processor(config)
        encoded = encode_prompt(trainer_processor, Sample(0, [], "<video> what?", "1", videos=[clip]), task, 4096)
        ids = encoded.input_ids.tolist()
        collapsed, _ = adapter.vllm_collapse_videos(ids)
        items, request_kwargs = adapter.vllm_video_items([clip])
        result = processor.apply(ProcessorInputs(prompt=collapsed,
                                                 mm_data_items=processor.info.parse_mm_data({"video": items}),
                                                 hf_processor_mm_kwargs=request_kwargs),
                                 timing_ctx=TimingContext(enabled=False))
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    out["ids_equal"] = list(result["prompt_token_ids"]) == ids
    item = result["mm_kwargs"]["video"][0]
    if "second_per_grid_ts" in item:
        out.update(second_per_grid_ts_vllm=float(item["second_per_grid_ts"].data),
                   second_per_grid_ts_trainer=float(encoded.second_per_grid_ts[0]))
        out["seconds_equal"] = out["second_per_grid_ts_vllm"] == out["second_per_grid_ts_trainer"]
    out["ok"] = bool(out["ids_equal"] and out.get("seconds_equal", True))
    return out


def run_checks(family: str, model: str, max_images: int = 2, task: str = "clevr",
               kwargs: dict | None = None, video_cache_gb: float | None = None) -> list[dict]:
    """All checks for one model folder; `kwargs` replaces the adapter's `vllm_processor_kwargs`."""
    from transformers import AutoConfig

    from data.processing import load_processor
    from models.family import build_adapter

    adapter = build_adapter(AutoConfig.from_pretrained(model, local_files_only=True))
    if kwargs is None:
        kwargs = adapter.vllm_processor_kwargs(MIN_PIXELS, MAX_PIXELS)
    results = [{"check": "setup", "family": family, "model": model, "mm_processor_kwargs": kwargs,
                "patched": _patch_vllm(family)}]
    videos = 1 if adapter.takes_video else 0
    try:
        config, processor = build_vllm_processor(model, kwargs, max_images, max_videos=videos,
                                                 hf_overrides=adapter.vllm_engine_kwargs().get("hf_overrides"))
    except Exception as err:  # noqa: BLE001 - vLLM's config validation and model inspection raise here
        results[0].update(ok=False, error=f"{type(err).__name__}: {err}"[:2000])
        return results
    results[0].update(processor=type(processor).__name__, ok=True)
    results.append(check_startup(config, max_images))
    trainer_processor = load_processor(model)
    vocab = trainer_processor.tokenizer.get_vocab()
    for count in range(1, max_images + 1):
        results.append(check_prompt(processor, config, trainer_processor, adapter, vocab, count, task))
    for case in range(3 if videos else 0):
        results.append(check_video_prompt(processor, config, trainer_processor, adapter, vocab, case, task))
    if videos:
        results.append(check_video_cache(model, kwargs, trainer_processor, adapter, task, video_cache_gb))
        results.append(check_video_seconds(model, kwargs, trainer_processor, adapter, task))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, help="the family the folder holds (for the report)")
    parser.add_argument("--model", required=True, help="model folder (e.g. from tools/make_tiny_model.py)")
    parser.add_argument("--max-images", type=int, default=2)
    parser.add_argument("--processor-kwargs", type=json.loads, default=None,
                        help="JSON mm_processor_kwargs to try instead of the adapter's")
    parser.add_argument("--video-cache-gb", type=float, default=None,
                        help="processor cache of the video_cache check (default: what the engine gives vLLM)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout holds the JSON lines only
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = run_checks(args.family, args.model, args.max_images, kwargs=args.processor_kwargs,
                         video_cache_gb=args.video_cache_gb)
    for r in results:
        print(json.dumps(r, default=str), flush=True)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
