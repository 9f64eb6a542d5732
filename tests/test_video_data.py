"""Video inputs, the data side: decoding and sampling, canonical frames, frame lists, the videos column
and Video-R1's rows, bad input skipped with its reason, the procedural video task and its reward."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

av = pytest.importorskip("av")

import data.datasets as datasets  # noqa: E402
import data.video as video  # noqa: E402
from data.datasets import SkipStats, VLDataset  # noqa: E402
from data.generators import video as video_gen  # noqa: E402
from data.images import BadSample  # noqa: E402
from data.rewards import score  # noqa: E402
from data.video import VIDEO_TAG, Video, decode_video  # noqa: E402
from grpo.config import ConfigError, load_config  # noqa: E402
from tools.make_dataset import make_dataset  # noqa: E402

VIDEO_ROWS = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def grey_frames(n: int, width: int = 64, height: int = 64) -> list[np.ndarray]:
    """Frame i is a flat grey of level 20 + 10 i, so a decoded frame says which source frame it was."""
    return [np.full((height, width, 3), 20 + 10 * i, np.uint8) for i in range(n)]


def encode(frames: list[np.ndarray], fps: float, fmt: str = "mp4", codec: str = "libx264") -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "4", "threads": "1"}
        container.start_encoding()
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def source_index(frame: Image.Image) -> int:
    return round((np.asarray(frame, dtype=np.float64).mean() - 20) / 10)


@pytest.fixture(scope="module")
def clip8() -> bytes:
    return encode(grey_frames(8), fps=4)  # 2 s


# --- decoding and sampling ------------------------------------------------------------------------


@pytest.mark.parametrize("fps, expected", [(2.0, [0.0, 0.5, 1.0, 1.5]), (4.0, [0.25 * i for i in range(8)])])
def test_decode_samples_at_the_asked_rate_with_source_timestamps(clip8, fps, expected):
    clip = decode_video(clip8, fps=fps)
    assert isinstance(clip, Video) and clip.fps == fps
    assert clip.timestamps == pytest.approx(expected)
    # each kept frame is the source frame shown at its timestamp (4 source frames a second)
    assert [source_index(f) for f in clip.frames] == [round(t * 4) for t in expected]


def test_decode_never_samples_faster_than_the_stream(clip8):
    clip = decode_video(clip8, fps=30.0)
    assert len(clip.frames) == 8 and clip.fps == 4.0


def test_max_frames_spreads_the_frames_evenly_over_the_clip():
    clip = decode_video(encode(grey_frames(16), fps=4), fps=4.0, max_frames=4)  # 4 s, 16 frames
    assert clip.timestamps == pytest.approx([0.0, 1.0, 2.0, 3.0]) and clip.fps == 1.0
    assert [source_index(f) for f in clip.frames] == [0, 4, 8, 12]
    # a max_frames that is not a multiple of the temporal patch rounds down to one
    assert len(decode_video(encode(grey_frames(16), fps=4), fps=4.0, max_frames=5).frames) == 4


def test_frame_count_is_padded_to_the_frame_multiple():
    five = encode(grey_frames(5), fps=2)
    clip = decode_video(five, fps=2.0)
    assert len(clip.frames) == 6 and clip.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.0])
    assert clip.frames[5].tobytes() == clip.frames[4].tobytes()
    assert len(decode_video(five, fps=2.0, frame_multiple=1).frames) == 5
    assert len(decode_video(five, fps=2.0, frame_multiple=4).frames) == 8


@pytest.mark.parametrize("factor", [28, 32])
def test_frames_share_one_canonical_size_within_the_clip_budget(factor):
    data = encode(grey_frames(8, width=320, height=180), fps=2)
    budget = 8 * 96 * 96
    clip = decode_video(data, fps=2.0, video_max_pixels=budget, max_pixels=512 * 28 * 28, factor=factor)
    width, height = clip.size
    assert {f.size for f in clip.frames} == {(width, height)} and {f.mode for f in clip.frames} == {"RGB"}
    assert width % factor == 0 and height % factor == 0
    assert len(clip.frames) * width * height <= budget
    assert width > height  # the aspect ratio survives
    # the image max_pixels bounds each frame as well
    small = decode_video(data, fps=2.0, video_max_pixels=10**8, max_pixels=56 * 56, min_pixels=28 * 28)
    assert small.size[0] * small.size[1] <= 56 * 56
    # the clip budget wins over a large image min_pixels (geo3k's configs ask 512 x 512)
    large_min = decode_video(data, fps=2.0, video_max_pixels=budget, min_pixels=512 * 512, max_pixels=1024 * 1024)
    assert len(large_min.frames) * large_min.size[0] * large_min.size[1] <= budget


def test_settings_that_cannot_hold_together_fail_naming_them():
    with pytest.raises(ValueError, match="video_max_pixels"):
        decode_video(b"unused", video_max_pixels=1000, max_frames=32)
    with pytest.raises(ValueError, match="max_frames"):
        decode_video(b"unused", max_frames=1)


def test_frame_lists_of_images_bytes_and_paths(tmp_path):
    arrays = grey_frames(10)
    images = [Image.fromarray(a) for a in arrays]
    encoded = []
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
        (tmp_path / f"f{i}.png").write_bytes(buffer.getvalue())
    paths = [str(tmp_path / f"f{i}.png") for i in range(10)]
    for source in (images, encoded, paths):
        clip = decode_video(source, fps=2.0, max_frames=4)
        assert [source_index(f) for f in clip.frames] == [0, 2, 5, 7]
        assert clip.timestamps == pytest.approx([0.0, 1.0, 2.5, 3.5]) and clip.fps == pytest.approx(0.8)
    clip = decode_video(images[:3], fps=1.0)
    assert len(clip.frames) == 4 and clip.timestamps == [0.0, 1.0, 2.0, 2.0]
    mixed = decode_video([Image.new("L", (64, 64), 50), Image.new("RGBA", (128, 96), (60, 60, 60, 255))], fps=1.0)
    assert {f.size for f in mixed.frames} == {mixed.size} and {f.mode for f in mixed.frames} == {"RGB"}


# --- bad input ------------------------------------------------------------------------------------


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def test_each_bad_video_is_skipped_and_counted_with_its_reason(tmp_path, monkeypatch, clip8):
    long_clip = encode(grey_frames(24), fps=8)
    indexed_first = _faststart(tmp_path / "faststart.mp4", np.random.default_rng(0).integers(0, 255, (8, 64, 64, 3), np.uint8))
    big_frames = encode(grey_frames(4, width=256, height=256), fps=2)
    rows = [
        ([clip8], "<video>ok"),
        ([clip8[: len(clip8) // 2]], "truncated"),
        ([clip8[:-120]], "truncated index"),
        ([indexed_first[: len(indexed_first) * 3 // 4]], "truncated frames, index intact"),
        ([b"this is not a video at all"], "garbage"),
        ([audio_only()], "audio only"),
        ([_empty_avi()], "no frames"),
        ([b"over the byte cap"], "over the byte cap"),
        ([big_frames], "frames over the pixel cap"),
        ([long_clip], "too many frames"),
        ([clip8], "<video><video>two tags, one video"),
        ([None], "neither bytes nor path"),
    ]
    cap = max(len(b or b"") for videos, _ in rows for b in videos) + 100
    rows[7] = ([clip8 + b"\0" * cap], "over the byte cap")
    table = pa.table({
        "videos": pa.array([[{"bytes": b, "path": None} for b in videos] for videos, _ in rows], VIDEO_ROWS),
        "problem": [problem for _, problem in rows], "answer": ["1"] * len(rows),
    })
    pq.write_table(table, tmp_path / "bad.parquet")
    # the caps are read before any frame is decoded: decoding a rejected clip would fail this test
    real_decode = video._decode_chosen

    def decode_guard(container, stream, wanted, fit, where):
        assert stream.codec_context.width * stream.codec_context.height <= 200 * 200 and stream.frames <= 20
        return real_decode(container, stream, wanted, fit, where)

    monkeypatch.setattr(video, "_decode_chosen", decode_guard)
    dataset = VLDataset(tmp_path / "bad.parquet", "video", max_video_bytes=cap,
                        max_source_frames=20, max_image_pixels=200 * 200)
    stats = SkipStats()
    samples = list(dataset.iter_samples(range(len(rows)), stats))
    assert [s.index for s in samples] == [0]
    assert stats.as_dict() == {"bad_video": 4, "empty_video": 1, "missing_video": 1, "no_video_stream": 1,
                               "video_count_mismatch": 1, "video_too_large": 2, "video_too_long": 1}


def _faststart(path, frames: np.ndarray) -> bytes:
    """An mp4 whose index comes before its frames, so a cut file still opens and lists every frame."""
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


def _empty_avi() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="avi") as container:
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuvj420p"
        container.start_encoding()
    return buffer.getvalue()


def test_byte_cap_is_checked_before_a_file_is_opened(tmp_path, monkeypatch, clip8):
    path = tmp_path / "big.mp4"
    path.write_bytes(clip8)
    monkeypatch.setattr(av, "open", lambda *a, **k: pytest.fail("opened a file over the byte cap"))
    with pytest.raises(BadSample) as bad:
        decode_video(path, max_bytes=len(clip8) - 1)
    assert bad.value.reason == "video_too_large" and str(path) in bad.value.detail
    with pytest.raises(BadSample) as bad:
        decode_video(tmp_path / "absent.mp4")
    assert bad.value.reason == "missing_video"
    with pytest.raises(BadSample) as bad:
        decode_video([])
    assert bad.value.reason == "empty_video"


def test_a_row_over_the_byte_cap_is_refused_before_its_cell_is_converted(tmp_path, monkeypatch, clip8):
    pq.write_table(pa.table({"videos": pa.array([[{"bytes": clip8 * 3, "path": None}]], VIDEO_ROWS),
                             "problem": ["q"], "answer": ["1"]}), tmp_path / "v.parquet")
    dataset = VLDataset(tmp_path / "v.parquet", "video", max_video_bytes=len(clip8))
    monkeypatch.setattr(datasets, "_video_refs", lambda value: pytest.fail("converted an over-cap videos cell"))
    with pytest.raises(BadSample) as bad:
        dataset.get(0)
    assert bad.value.reason == "video_too_large"


# --- dataset schemas ------------------------------------------------------------------------------


def test_videos_column_forms_and_tags(tmp_path, clip8):
    (tmp_path / "clip.mp4").write_bytes(clip8)
    frames = []
    for i, array in enumerate(grey_frames(4)):
        Image.fromarray(array).save(tmp_path / f"frame{i}.png")
        frames.append(f"frame{i}.png")
    rows = [
        {"videos": "clip.mp4", "problem": "How many?", "answer": "3"},  # one path, no tag: prepended
        {"videos": ["clip.mp4", frames], "problem": "Compare <video> with <video>.", "answer": "same"},
        {"videos": None, "problem": "text only", "answer": "x"},
    ]
    with (tmp_path / "rows.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    dataset = VLDataset(tmp_path / "rows.jsonl", "video")
    first, second, third = (dataset.get(i) for i in range(3))
    assert first.problem == f"{VIDEO_TAG}How many?" and len(first.videos) == 1 and first.images == []
    assert len(first.videos[0].frames) == 4  # 2 s at 2 fps
    assert second.problem.count(VIDEO_TAG) == 2 and len(second.videos) == 2
    assert [source_index(f) for f in second.videos[1].frames] == [0, 1, 2, 3]
    assert second.videos[1].timestamps == [0.0, 0.5, 1.0, 1.5]
    assert third.videos == [] and third.images == []


def test_video_r1_rows_load_through_the_path_alias(tmp_path, clip8):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(clip8)
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "imgs" / "x.png")
    rows = [  # Video-R1-260k.json's fields (one JSON array, relative paths starting with ./)
        {"problem_id": 1, "problem": "What does the person pick up?", "data_type": "video",
         "problem_type": "multiple choice", "options": ["A. a cup", "B. a book"], "process": "",
         "solution": "<answer>B</answer>", "path": "./clips/a.mp4", "data_source": "STAR"},
        {"problem_id": 2, "problem": "How many red squares are there?", "data_type": "image",
         "problem_type": "numerical", "options": [], "process": "", "solution": "<answer>1</answer>",
         "path": "./imgs/x.png", "data_source": "CLEVR"},
        {"problem_id": 3, "problem": "q", "data_type": "audio", "problem_type": "free-form", "options": [],
         "process": "", "solution": "<answer>x</answer>", "path": "./clips/a.mp4", "data_source": "?"},
    ]
    (tmp_path / "Video-R1-260k.json").write_text(json.dumps(rows, indent=4))
    dataset = VLDataset(tmp_path / "Video-R1-260k.json", "video")
    stats = SkipStats()
    clip, image = list(dataset.iter_samples(range(3), stats))
    assert stats.as_dict() == {"wrong_type": 1}
    assert clip.problem == f"{VIDEO_TAG}What does the person pick up?\nOptions:\nA. a cup\nB. a book"
    assert clip.answer == "B" and len(clip.videos) == 1 and clip.images == []
    assert clip.videos[0].timestamps == [0.0, 0.5, 1.0, 1.5]
    assert image.problem == "<image>How many red squares are there?" and len(image.images) == 1
    assert image.videos == [] and image.answer == "1"


def test_a_file_without_images_videos_or_path_names_what_it_needs(tmp_path):
    pq.write_table(pa.table({"problem": ["q"], "answer": ["a"]}), tmp_path / "none.parquet")
    with pytest.raises(ValueError, match="'videos'.*Video-R1's 'path'"):
        VLDataset(tmp_path / "none.parquet", "video")


# --- the procedural task, its reward and its config keys ------------------------------------------


def test_generated_clips_decode_and_their_answers_match_what_they_show(tmp_path):
    out = make_dataset("video", 12, 3, tmp_path / "video.parquet", fps=4.0, frames=8, size=(96, 64))
    again = make_dataset("video", 12, 3, tmp_path / "again.parquet", fps=4.0, frames=8, size=(96, 64))
    assert pq.read_table(out).equals(pq.read_table(again))  # row i depends only on (seed, i)
    dataset = VLDataset(out, "video", video_fps=4.0, max_frames=8)
    kinds = set()
    for i in range(len(dataset)):
        sample = dataset.get(i)
        clip = decode_video(pq.read_table(out).column("videos")[i].as_py()[0]["bytes"], fps=4.0, factor=2,
                            video_max_pixels=10**7)  # full size, to measure
        assert len(sample.videos[0].frames) == 8 and clip.size == (96, 64)
        arrays = [np.asarray(f, dtype=np.int32) for f in clip.frames]
        if "red square" in sample.problem:
            kinds.add("count")
            red = [((a[..., 0] > 150) & (a[..., 1] < 90) & (a[..., 2] < 90)).sum() > 40 for a in arrays]
            assert str(sum(red)) == sample.answer
        else:
            kinds.add("direction")
            xs, ys = zip(*(_centroid((a[..., 1] > 120) & (a[..., 0] < 90) & (a[..., 2] < 120)) for a in arrays))
            dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
            moved = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert moved == sample.answer and max(abs(dx), abs(dy)) > 15
    assert kinds == {"count", "direction"}


def _centroid(mask: np.ndarray) -> tuple[float, float]:
    ys, xs = np.nonzero(mask)
    return float(xs.mean()), float(ys.mean())


def test_generator_writes_jsonl_with_clip_files_beside_it(tmp_path):
    out = make_dataset("video", 2, 0, tmp_path / "v.jsonl")
    row = json.loads(out.read_text().splitlines()[0])
    assert row["videos"] == ["v_videos/video_0.mp4"] and (tmp_path / "v_videos" / "video_0.mp4").is_file()
    assert len(VLDataset(out, "video").get(0).videos[0].frames) == 8  # 8 frames at 2 fps, sampled at 2 fps
    with pytest.raises(ValueError, match="even"):
        video_gen.generate(1, 0, size=(97, 64))


def test_video_reward_is_clevr_style():
    assert score("video", "<think>it moves</think><answer>Left</answer>", "left").score == pytest.approx(1.0)
    assert score("video", "<answer>3.0</answer>", "3").accuracy == 1.0
    assert score("video", "<answer>4</answer>", "3").score == pytest.approx(0.2)
    assert score("video", "<answer>(B) a book</answer>", "B").accuracy == 1.0
    assert score("video", "<answer>A</answer>", "B").reason == "wrong_answer"
    assert score("video", "<answer>left</answer> more", "left").score == pytest.approx(0.8)
    assert score("video", "left", "left").score == 0.0


def test_video_config_keys_defaults_and_range_checks():
    cfg = load_config(None, [])
    assert (cfg.data.video_fps, cfg.data.max_frames, cfg.data.max_video_bytes) == (2.0, 32, 256 << 20)
    assert cfg.data.video_max_pixels == 2048 * 28 * 28 and cfg.data.max_source_frames == 36_000
    for override, key in (("data.video_fps=0", "data.video_fps"), ("data.max_frames=1", "data.max_frames"),
                          ("data.video_max_pixels=1000", "data.video_max_pixels"),
                          ("data.max_video_bytes=0", "data.max_video_bytes")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])


def test_random_frame_lists_keep_order_and_count():
    rng = random.Random(0)
    for _ in range(5):
        n, cap = rng.randint(1, 20), rng.choice([2, 4, 8, 16])
        clip = decode_video([Image.fromarray(a) for a in grey_frames(n)], fps=2.0, max_frames=cap)
        kept = [source_index(f) for f in clip.frames]
        assert len(kept) % 2 == 0 and len(kept) <= max(cap, 2) and kept == sorted(kept)


def test_parquet_frame_lists_in_a_videos_column(tmp_path):
    encoded = []
    for array in grey_frames(6):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        encoded.append({"bytes": buffer.getvalue(), "path": None})
    frames_type = pa.list_(pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))
    pq.write_table(pa.table({"videos": pa.array([[encoded]], frames_type), "problem": ["<video>q"],
                             "answer": ["1"]}), tmp_path / "frames.parquet")
    sample = VLDataset(tmp_path / "frames.parquet", "video", video_fps=1.0).get(0)
    assert [source_index(f) for f in sample.videos[0].frames] == list(range(6))
    assert sample.videos[0].timestamps == [float(i) for i in range(6)] and sample.videos[0].fps == 1.0
