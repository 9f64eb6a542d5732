"""The vLLM request for video prompts, and the processor cache where vLLM 0.26 cannot serve them.

vLLM is not installed here; tools/vllm_prompt_check.py runs vLLM's own processor on the same
prompts (its `video_cache` check replays the partial cache hit described in
`QwenVLAdapter.vllm_processor_cache_safe`).
"""

from __future__ import annotations

import pytest
from PIL import Image

from data.datasets import Sample
from data.processing import encode_prompt, load_processor
from data.video import Video
from models.family import build_adapter
from models.policy import load_model_config


def _clip(n: int, side: int, fps: float, seed: int) -> Video:
    return Video([Image.new("RGB", (side, side), ((40 * i + 70 * seed) % 256, 100, 30 * seed)) for i in range(n)],
                 fps=fps)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen3_vl", family="qwen3_vl", size="tiny", seed=0)


def test_processor_cache_is_off_for_qwen2_5_prompts_of_two_videos(tiny_model, qwen3_vl):
    """Qwen2.5-VL's timing goes as the request's `video_metadata`, which vLLM hands whole to transformers
    beside only the clips its cache missed: with two or more videos per prompt the cache is off. One
    video, no video, and Qwen3-VL (metadata in each item) keep it."""
    from rollout.vllm_engine import processor_cache

    qwen2_5 = build_adapter(load_model_config(str(tiny_model)))
    qwen3 = build_adapter(load_model_config(str(qwen3_vl)))
    assert processor_cache(qwen2_5, 4.0, 2) == 0.0 and processor_cache(qwen2_5, 4.0, 5) == 0.0
    assert processor_cache(qwen2_5, 4.0, 1) == 4.0 and processor_cache(qwen2_5, 4.0, 0) == 4.0
    assert processor_cache(qwen3, 4.0, 2) == 4.0
    assert processor_cache(qwen2_5, 0.0, 2) == 0.0


def test_two_video_request_gives_each_clip_its_own_timing_in_order(tiny_model, qwen3_vl):
    """The request the engine builds for [clip at 1 fps, image, clip at 4 fps]: one collapsed target per
    video, frames as (T, H, W, 3) arrays in prompt order, and the timing per clip in the same order
    (Qwen2.5-VL: the request's `video_metadata`, whose sampled fps transformers turns into
    second_per_grid_ts; Qwen3-VL: each item's own metadata)."""
    import rollout.vllm_engine as vllm_engine
    from rollout.base import PromptInput

    for path in (tiny_model, qwen3_vl):
        processor = load_processor(str(path))
        adapter = build_adapter(load_model_config(str(path)))
        side = processor.images.factor
        videos = [_clip(4, side, 1.0, 1), _clip(2, 2 * side, 4.0, 2)]
        sample = Sample(0, [Image.new("RGB", (side, side), (9, 9, 9))], "<video> then <image> then <video>?", "1",
                        videos=videos)
        p = encode_prompt(processor, sample, "generic", 4096)
        engine = object.__new__(vllm_engine.VLLMEngine)
        engine.adapter, engine.family = adapter, adapter.name
        engine._vocab = processor.tokenizer.get_vocab()
        engine.max_images_per_prompt, engine.max_videos_per_prompt = 1, 2
        request = engine._vllm_prompt(0, PromptInput(p.input_ids.tolist(), p.images, p.pixel_values,
                                                     p.image_grid_thw, p.videos, p.pixel_values_videos,
                                                     p.video_grid_thw, p.second_per_grid_ts))
        assert request["prompt_token_ids"].count(adapter.video_token_id) == 2
        items = request["multi_modal_data"]["video"]
        if adapter.name == "qwen2_5_vl":
            metas = request["mm_processor_kwargs"]["video_metadata"]
            frames = items
            assert [len(m["frames_indices"]) / m["total_num_frames"] * m["fps"] for m in metas] == [1.0, 4.0]
            assert [2 / (len(m["frames_indices"]) / m["total_num_frames"] * m["fps"]) for m in metas] == \
                p.second_per_grid_ts.tolist()
        else:
            assert "mm_processor_kwargs" not in request
            frames = [f for f, _ in items]
            assert [m["fps"] for _, m in items] == [1.0, 4.0]
            assert [m["frames_indices"] for _, m in items] == [[0, 1, 2, 3], [0, 1]]
        assert [f.shape for f in frames] == [(4, side, side, 3), (2, 2 * side, 2 * side, 3)]


@pytest.mark.parametrize("fps", [0.9, 3.0])
def test_qwen2_5_seconds_and_positions_survive_the_engine_dtype(fps, tiny_model):
    """vLLM casts transformers' `second_per_grid_ts` (temporal patch / the metadata's sampled fps, float32)
    to the engine's dtype before its m-rope positions read it. The trainer's seconds and the request's
    metadata give the same number in bf16, fp16 and fp32, so vLLM's temporal positions (its
    `get_mrope_input_positions`: ⌊g · seconds · tokens_per_second⌋) equal the trainer's. At 0.9 fps
    (a 35 s clip thinned to 32 frames) float32 2/fps would put group 9 one position off in a bf16 engine."""
    import numpy as np
    import torch

    processor = load_processor(str(tiny_model))
    adapter = build_adapter(load_model_config(str(tiny_model)))
    video = _clip(32, processor.images.factor, fps, 0)
    ours = processor.images.encode_videos([video])["second_per_grid_ts"]
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(2 / fps, rel=4e-3)
    _, kwargs = adapter.vllm_video_items([video])
    meta = kwargs["video_metadata"][0]
    theirs = torch.tensor([2 / (len(meta["frames_indices"]) / meta["total_num_frames"] * meta["fps"])])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert theirs.to(dtype).item() == ours.item(), dtype
    grid = torch.tensor([[16, 2, 2]])
    (_, _, _, step), = adapter.video_segments(grid, ours)
    vllm = (np.arange(16) * (theirs.to(torch.bfloat16).item() * adapter.tokens_per_second)).astype(np.int64)
    assert [int(g * step) for g in range(16)] == vllm.tolist()
