"""Video inputs: a decoded, canonical clip as the rest of vlrl sees it, and the one decoder that makes it.

`Video` is the contract between the data side (decoding, sampling, canonicalization, bad input)
and the model side (processor fields, positions, engines). The decoder fills it; nothing after it
reads a file again.

Decoder: PyAV (`av` on PyPI; its wheels bundle FFmpeg, so no system library is needed). It is
imported only when a video file is decoded: a clip given as a list of frames needs no decoder.

`decode_video` reads a clip in two passes over the container: the first demuxes packets only (no
pixel is decoded) to learn every frame's presentation time from the stream's own time base; the
sampled frames are chosen from those times; the second decodes up to the last chosen frame and
keeps only the chosen ones. Sampling:
  - frames are taken at `fps` (never faster than the stream's own average rate) from the first
    frame's time on, each target time taking the frame nearest to it;
  - when that gives more than `max_frames` (rounded down to a multiple of `frame_multiple`), that
    many target times are spread evenly over the clip instead, and `Video.fps` is their rate;
  - a count that is not a multiple of `frame_multiple` (the family's temporal patch: 2 for
    Qwen2/2.5-VL, Qwen3-VL and Qwen3.5) is padded by repeating the last frame and its timestamp,
    as the Hugging Face video processors pad;
  - timestamps are the chosen frames' presentation times in seconds from the first frame.
Every frame is resized (BICUBIC, as soon as it is decoded) to one size: sides multiples of
`factor`, and pixels per frame within min(max_pixels, video_max_pixels // n_frames) (and at least
min_pixels where that budget allows), so the clip's total stays within `video_max_pixels`
(`data.images.smart_resize_dims` picks the size).

A list of frames (PIL images, encoded image bytes, or image paths; Video-R1 and EasyR1 rows allow
them) is taken as already sampled at `fps`: frame i has timestamp i / fps; more than `max_frames`
are thinned evenly.

Bad input raises `BadSample` with a reason (counted by `data.datasets.SkipStats`):
  - "missing_video": a path that is not a file;
  - "video_too_large": the file (or bytes, or a frame list's encoded frames together) over
    `max_bytes`, checked before anything is read; or a frame size in the container header over
    `max_frame_pixels`, checked before any frame is decoded;
  - "video_too_long": more than `max_source_frames` frames, from the header (its frame count, or
    duration × rate) before decoding, and again while demuxing (a header can lie);
  - "bad_video": FFmpeg cannot open, demux or decode it, a truncated file (fewer packets than its
    header lists), packets without timestamps, or an unreadable frame of a frame list;
  - "no_video_stream": a container with no video stream (an audio file, say);
  - "empty_video": a video stream with no frames, or an empty frame list.
"""

from __future__ import annotations

import bisect
import functools
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from PIL import Image

from data.images import DEFAULT_MAX_IMAGE_PIXELS, BadSample, decode_image, smart_resize_dims, to_rgb

VIDEO_TAG = "<video>"

DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MAX_FRAMES = 32
# Whole-clip pixel budget: 2048 patches of 28 x 28 (about 1024 placeholder tokens for Qwen2.5-VL,
# whose tokens each cover 2 frames x 28 x 28 pixels); 32 frames of 224 x 224 fit.
DEFAULT_VIDEO_MAX_PIXELS = 2048 * 28 * 28
DEFAULT_MAX_VIDEO_BYTES = 256 << 20
# Frames a source may hold: 20 minutes at 30 fps. Demuxing reads every packet and decoding reads
# every frame up to the last one sampled, so this bounds one clip's decode cost.
DEFAULT_MAX_SOURCE_FRAMES = 36_000


@dataclass
class Video:
    """One clip, decoded once per prompt.

    frames: RGB PIL images, all the same size, sides multiples of the family's factor, their total
        pixels within the video's budget, and their count a multiple of the family's temporal patch.
    fps: the rate at which `frames` were sampled (frames per second of source time).
    timestamps: each frame's time in the source, in seconds (len(timestamps) == len(frames)).
    source: where it came from, for messages (a path, or "<bytes>" / "<frames>").
    """

    frames: list[Image.Image]
    fps: float
    timestamps: list[float] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.timestamps:
            self.timestamps = [i / self.fps for i in range(len(self.frames))]
        if len(self.timestamps) != len(self.frames):
            raise ValueError(f"{len(self.timestamps)} timestamps for {len(self.frames)} frames ({self.source})")

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of every frame."""
        return self.frames[0].size


def decode_video(
    source: bytes | str | os.PathLike | Sequence[Any],
    *,
    fps: float = DEFAULT_VIDEO_FPS,
    max_frames: int = DEFAULT_MAX_FRAMES,
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    min_pixels: int = 28 * 28,
    max_pixels: int = 512 * 28 * 28,
    video_max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS,
    max_source_frames: int = DEFAULT_MAX_SOURCE_FRAMES,
    max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    factor: int = 28,
    frame_multiple: int = 2,
    where: str = "",
) -> Video:
    """Decode, sample and canonicalize one clip (see the module docstring).

    `source` is a video file's path or encoded bytes, or a list of frames (PIL images, encoded
    image bytes, or image paths). `min_pixels`/`max_pixels` bound each frame as they bound an
    image; `video_max_pixels` bounds the whole clip. `where` names the clip in messages. Raises
    BadSample for bad input and ValueError for arguments that cannot hold together.
    """
    check_video_options(fps=fps, max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels,
                        video_max_pixels=video_max_pixels, factor=factor, frame_multiple=frame_multiple)
    cap = max_frames // frame_multiple * frame_multiple
    size_rule = functools.partial(canonical_frame_size, min_pixels=min_pixels, max_pixels=max_pixels,
                                  video_max_pixels=video_max_pixels, factor=factor)
    if isinstance(source, (list, tuple)):
        where = where or "<frames>"
        frames, times, rate = _sample_frame_list(source, fps, cap, frame_multiple, size_rule, max_bytes,
                                                 max_source_frames, max_frame_pixels, where)
    elif isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)):
        where = where or (str(source) if isinstance(source, (str, os.PathLike)) else "<bytes>")
        frames, times, rate = _decode_stream(source, fps, cap, frame_multiple, size_rule, max_bytes,
                                             max_source_frames, max_frame_pixels, where)
    else:
        raise BadSample("wrong_type", f"{where or 'video'} is {type(source).__name__}; expected a path, bytes or "
                                      "a list of frames")
    while len(frames) % frame_multiple:
        frames.append(frames[-1])
        times.append(times[-1])
    return Video(frames=frames, fps=float(rate), timestamps=times, source=where)


class _Fit:
    """Resizes each kept frame, as it is decoded, to the clip's one canonical size, taken from the first
    frame's size and the clip's frame count after padding (so at most one full-size frame is held)."""

    def __init__(self, size_rule: Callable, n_kept: int, frame_multiple: int):
        self.size_rule = size_rule
        self.n_frames = n_kept + (-n_kept) % frame_multiple
        self.size: tuple[int, int] | None = None

    def __call__(self, image: Image.Image) -> Image.Image:
        if self.size is None:
            self.size = self.size_rule(image.width, image.height, self.n_frames)
        return _resized(image, *self.size)


def canonical_frame_size(
    width: int, height: int, n_frames: int, *, min_pixels: int, max_pixels: int, video_max_pixels: int,
    factor: int = 28,
) -> tuple[int, int]:
    """(width, height) every frame of an `n_frames` clip is resized to: sides multiples of `factor`, pixels
    within budget = min(max_pixels, video_max_pixels // n_frames), and at least min(min_pixels, budget): the
    clip's budget wins over the images' min_pixels."""
    budget = min(max_pixels, video_max_pixels // n_frames)
    if budget < factor * factor:
        raise ValueError(f"video_max_pixels={video_max_pixels} leaves {budget} pixels a frame for {n_frames} frames, "
                         f"less than one {factor}x{factor} patch")
    try:
        h, w = smart_resize_dims(height, width, factor=factor, min_pixels=min(min_pixels, budget), max_pixels=budget)
        if h * w > budget:  # scaling up to min_pixels rounds each side up, which can pass a budget that close
            h, w = smart_resize_dims(height, width, factor=factor, min_pixels=factor * factor, max_pixels=budget)
    except BadSample as bad:  # smart_resize_dims speaks of images
        raise BadSample("bad_video", f"frame size {width}x{height}: {bad.detail}") from bad
    return w, h


def check_video_options(*, fps: float, max_frames: int, min_pixels: int, max_pixels: int, video_max_pixels: int,
                        factor: int = 28, frame_multiple: int = 2) -> None:
    """Raise ValueError, naming the argument, when decode_video's settings cannot hold together."""
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise ValueError(f"video settings: fps must be a positive number, got {fps!r}")
    if frame_multiple < 1 or factor < 1:
        raise ValueError(f"video settings: frame_multiple ({frame_multiple}) and factor ({factor}) must be >= 1")
    if max_frames < frame_multiple:
        raise ValueError(f"video settings: max_frames={max_frames} is below the frame multiple {frame_multiple}")
    if min_pixels > max_pixels:
        raise ValueError(f"video settings: min_pixels={min_pixels} is larger than max_pixels={max_pixels}")
    if video_max_pixels < max_frames // frame_multiple * frame_multiple * factor * factor:
        raise ValueError(f"video settings: video_max_pixels={video_max_pixels} cannot hold max_frames={max_frames} "
                         f"frames of one {factor}x{factor} patch each")


def _resized(frame: Image.Image, width: int, height: int) -> Image.Image:
    frame = to_rgb(frame)
    if frame.size == (width, height):
        return frame
    return frame.resize((width, height), resample=Image.Resampling.BICUBIC)


# --- sampling ------------------------------------------------------------------------------------


def sample_times(times: Sequence[float], fps: float, max_frames: int) -> tuple[list[int], float]:
    """Indices into the sorted frame `times` (seconds) to keep, and the rate they were sampled at.

    The clip lasts from the first frame to one frame past the last (the mean frame interval).
    Target times start at the first frame and step by 1 / rate, where rate is `fps` capped at the
    stream's average rate; when that gives more than `max_frames`, `max_frames` targets are spread
    evenly over the clip. Each target takes the frame nearest to it (the earlier one on a tie).
    """
    n_source = len(times)
    span = times[-1] - times[0]
    interval = span / (n_source - 1) if n_source > 1 and span > 0 else 1.0 / fps
    duration = span + interval
    rate = min(fps, n_source / duration)
    count = max(1, math.floor(duration * rate + 1e-6))
    if count > max_frames:
        count, rate = max_frames, max_frames / duration
    return [_nearest(times, times[0] + k / rate) for k in range(count)], rate


def _nearest(times: Sequence[float], target: float) -> int:
    right = bisect.bisect_left(times, target)
    if right == 0:
        return 0
    if right == len(times):
        return len(times) - 1
    return right if times[right] - target < target - times[right - 1] else right - 1


# --- files ---------------------------------------------------------------------------------------


def _import_av():
    try:
        import av
    except ImportError as err:  # an install problem, not a bad row: fail loudly
        raise ImportError("decoding video files needs PyAV: pip install av (a list of frames needs no decoder)") from err
    return av


def _decode_stream(source, fps: float, cap: int, frame_multiple: int, size_rule: Callable, max_bytes: int,
                   max_source_frames: int, max_frame_pixels: int, where: str) -> tuple[list[Image.Image], list[float], float]:
    """Sampled canonical frames of a video file or bytes, their timestamps and the sampling rate."""
    av = _import_av()
    opener = _opener(source, max_bytes, where)
    try:
        with opener() as container:
            stream = _video_stream(container, max_source_frames, max_frame_pixels, where)
            pts = _packet_times(container, stream, max_source_frames, where)
            seconds = [float((p - pts[0]) * stream.time_base) for p in pts]
        indices, rate = sample_times(seconds, fps, cap)
        fit = _Fit(size_rule, len(indices), frame_multiple)
        with opener() as container:
            chosen = _decode_chosen(container, container.streams.video[0], [pts[i] for i in indices], fit, where)
    except (av.FFmpegError, OSError) as err:
        raise BadSample("bad_video", f"{where}: {err}") from err
    return chosen, [seconds[i] for i in indices], rate


def _opener(source, max_bytes: int, where: str):
    """A function that opens the source as a PyAV container (twice: one per pass); sizes checked first."""
    av = _import_av()
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_bytes:
            raise BadSample("video_too_large", f"{where}: {len(data)} bytes > max_video_bytes={max_bytes}")
        if not data:
            raise BadSample("bad_video", f"{where}: empty")
        target = lambda: io.BytesIO(data)  # noqa: E731
    else:
        path = Path(source)
        if not path.is_file():
            raise BadSample("missing_video", f"no such file {path}")
        size = path.stat().st_size
        if size > max_bytes:
            raise BadSample("video_too_large", f"{where}: {size} bytes on disk > max_video_bytes={max_bytes}")
        target = lambda: str(path)  # noqa: E731

    def open_container():
        try:
            return av.open(target(), mode="r")
        except (av.FFmpegError, OSError, ValueError) as err:
            raise BadSample("bad_video", f"{where}: cannot open it ({err})") from err

    return open_container


def _video_stream(container, max_source_frames: int, max_frame_pixels: int, where: str):
    """The first video stream, its header checked: a frame size and a frame count within the caps."""
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise BadSample("no_video_stream", f"{where} has no video stream (streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0 or not stream.time_base:
        raise BadSample("bad_video", f"{where}: header says {width}x{height}, time base {stream.time_base}")
    if width * height > max_frame_pixels:
        raise BadSample("video_too_large", f"{where}: {width}x{height} frames > max_image_pixels={max_frame_pixels}")
    listed = _listed_frames(container, stream)
    if listed > max_source_frames:
        raise BadSample("video_too_long", f"{where}: its header lists {listed} frames > max_source_frames="
                                          f"{max_source_frames}")
    return stream


def _listed_frames(container, stream) -> int:
    """Frames the header promises: its frame count, else duration × average rate (0 when unknown)."""
    if stream.frames:
        return int(stream.frames)
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    else:
        return 0
    rate = stream.average_rate or stream.guessed_rate
    return math.ceil(seconds * float(rate)) if rate else 0


def _packet_times(container, stream, max_source_frames: int, where: str) -> list[int]:
    """Sorted presentation times (in the stream's time base) of every frame, from packets alone."""
    pts: list[int] = []
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's end-of-stream marker
            continue
        if packet.pts is None:
            raise BadSample("bad_video", f"{where}: a packet without a presentation time")
        pts.append(packet.pts)
        if len(pts) > max_source_frames:
            raise BadSample("video_too_long", f"{where}: more than max_source_frames={max_source_frames} frames")
    if stream.frames and len(pts) < stream.frames:
        raise BadSample("bad_video", f"{where}: truncated ({len(pts)} of the {stream.frames} frames its header lists)")
    if not pts:
        raise BadSample("empty_video", f"{where}: the video stream has no frames")
    return sorted(set(pts))


def _decode_chosen(container, stream, wanted: list[int], fit: Callable, where: str) -> list[Image.Image]:
    """The frames whose presentation times are in `wanted` (in that order, each through `fit`), decoding no
    further than the last."""
    stream.thread_type = "AUTO"
    found: dict[int, Image.Image] = {}
    last = max(wanted)
    targets = set(wanted)
    for frame in container.decode(stream):
        if frame.pts in targets and frame.pts not in found:
            found[frame.pts] = fit(frame.to_image())
        if frame.pts is not None and frame.pts >= last:
            break
    missing = [p for p in wanted if p not in found]
    if missing:
        raise BadSample("bad_video", f"{where}: {len(set(missing))} of the sampled frames did not decode "
                                     f"(first at pts {missing[0]}); the file may be truncated")
    return [found[p] for p in wanted]


# --- frame lists ---------------------------------------------------------------------------------

_IMAGE_TO_VIDEO_REASON = {"image_too_large": "video_too_large", "missing_image": "missing_video"}


def _sample_frame_list(items: Sequence[Any], fps: float, cap: int, frame_multiple: int, size_rule: Callable,
                       max_bytes: int, max_source_frames: int, max_frame_pixels: int,
                       where: str) -> tuple[list[Image.Image], list[float], float]:
    """Canonical frames of a list taken as sampled at `fps`: more than `cap` are thinned evenly."""
    if not items:
        raise BadSample("empty_video", f"{where}: an empty frame list")
    if len(items) > max_source_frames:
        raise BadSample("video_too_long", f"{where}: {len(items)} frames > max_source_frames={max_source_frames}")
    total = sum(_encoded_size(item, where, i) for i, item in enumerate(items))
    if total > max_bytes:
        raise BadSample("video_too_large", f"{where}: its frames hold {total} bytes > max_video_bytes={max_bytes}")
    n = len(items)
    indices = list(range(n)) if n <= cap else [k * n // cap for k in range(cap)]
    rate = fps if n <= cap else fps * cap / n
    fit = _Fit(size_rule, len(indices), frame_multiple)
    frames = [fit(_frame_image(items[i], where, i, max_bytes, max_frame_pixels)) for i in indices]
    return frames, [i / fps for i in indices], rate


def _encoded_size(item: Any, where: str, index: int) -> int:
    if isinstance(item, (bytes, bytearray, memoryview)):
        return len(item)
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if not path.is_file():
            raise BadSample("missing_video", f"{where}: frame {index}: no such file {path}")
        return path.stat().st_size
    if isinstance(item, Image.Image):
        return 0
    raise BadSample("wrong_type", f"{where}: frame {index} is {type(item).__name__}; expected a PIL image, image "
                                  "bytes or an image path")


def _frame_image(item: Any, where: str, index: int, max_bytes: int, max_frame_pixels: int) -> Image.Image:
    if isinstance(item, Image.Image):
        if item.width * item.height > max_frame_pixels:
            raise BadSample("video_too_large", f"{where}: frame {index} is {item.width}x{item.height} > "
                                               f"max_image_pixels={max_frame_pixels}")
        return to_rgb(item)
    try:
        return decode_image(item, max_image_pixels=max_frame_pixels, max_image_bytes=max_bytes)
    except BadSample as bad:
        reason = _IMAGE_TO_VIDEO_REASON.get(bad.reason, "bad_video")
        raise BadSample(reason, f"{where}: frame {index}: {bad.reason}: {bad.detail}") from bad
