"""Qwen3.5 video: m-rope positions against transformers' own `Qwen3_5Model.get_rope_index`."""

from __future__ import annotations

import pytest
import torch

from data.processing import load_processor
from data.video import Video
from tests.test_video_model import _adapter, _frames, _image, _prompt, _reference_positions


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen3_5", family="qwen3_5", size="tiny", seed=0)


@pytest.mark.parametrize("fps", [1.0, 4.0])
def test_qwen3_5_video_positions_equal_its_get_rope_index(fps, qwen3_5):
    """Image, then a video of 3 temporal groups, then text: each group is a one-frame run after its
    timestamp text, as Qwen3.5's reference splits `video_grid_thw`; the fps reaches the timestamps
    (and so the token count between groups), not the temporal positions."""
    processor = load_processor(str(qwen3_5))
    adapter = _adapter(qwen3_5)
    side = processor.images.factor
    video = Video(_frames(6, 3 * side, 2 * side), fps=fps)
    out = _prompt(processor, [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                              {"type": "text", "text": "what moves?"}], [_image(2 * side, side)], [video])
    assert out["video_grid_thw"].tolist() == [[3, 4, 6]]
    ours = adapter.position_ids(out["input_ids"], out["image_grid_thw"], out["video_grid_thw"], None)
    ref = _reference_positions(qwen3_5, out["input_ids"], out["image_grid_thw"], out["video_grid_thw"], None)
    assert torch.equal(ours[1:], ref)
    text = processor.tokenizer.decode(out["input_ids"])
    times = [f"<{(2 * g + 0.5) / fps:.1f} seconds>" for g in range(3)]
    assert all(t in text for t in times), (times, text)
    video_at = (out["input_ids"] == adapter.video_token_id).nonzero().flatten()
    groups = ours[1, video_at].unique()
    assert len(groups) == 3 and bool((ours[1, video_at].view(3, -1) == groups[:, None]).all())
