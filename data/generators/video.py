"""Short procedural clips with a question about what happens in them, in a `videos` row schema.

Each row holds one H.264 mp4 clip (libx264, yuv420p, one frame every 1/fps seconds) drawn with PIL:

- "count": a red square is shown in some frames, and a blue circle (or nothing) in the others;
  "In how many frames does the red square appear?", answered with the count (0 to all frames).
  The count is over the clip's frames, so a run should sample at `data.video_fps` >= the clip's
  fps (the defaults, 2 and 2, see every frame);
- "direction": a green circle moves in a straight line across the clip; "Which way does the green
  circle move?", answered with left, right, up or down (any sampling rate sees it).

Rows: {"videos": [{"bytes": mp4, "path": "video_<i>.mp4"}], "problem": "<video>...", "answer": "..."},
scored by the `video` reward (answer in <answer> </answer>, as CLEVR). Row i depends only on
(seed, i): the same seed gives byte-identical clips (x264 runs on one thread).
"""

from __future__ import annotations

import io
import random

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw

VIDEO_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
SCHEMA = pa.schema([("videos", VIDEO_TYPE), ("problem", pa.string()), ("answer", pa.string())])
QUESTION_KINDS = ("count", "direction")
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUND = (222, 222, 216)
RED, BLUE, GREEN = (210, 45, 45), (50, 90, 215), (45, 160, 70)
SUPERSAMPLE = 2  # draw at 2x and downsample: PIL's primitives are not antialiased
COUNT_QUESTION = "In how many frames does the red square appear? Answer with a number."
DIRECTION_QUESTION = "Which way does the green circle move: left, right, up or down?"


def _frame(size: tuple[int, int], shape: str | None = None, color=None, center=(0.0, 0.0), radius=0.0) -> np.ndarray:
    """One frame (H, W, 3 uint8) with at most one shape drawn on the background."""
    width, height = size
    s = SUPERSAMPLE
    canvas = Image.new("RGB", (width * s, height * s), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    x, y, r = center[0] * s, center[1] * s, radius * s
    outline = tuple(max(0, c - 60) for c in color) if color else None
    if shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=color, outline=outline, width=s)
    elif shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=color, outline=outline, width=s)
    return np.asarray(canvas.reduce(s))


def _random_center(rng: random.Random, size: tuple[int, int], radius: float) -> tuple[float, float]:
    width, height = size
    return rng.uniform(radius + 1, width - radius - 1), rng.uniform(radius + 1, height - radius - 1)


def count_clip(rng: random.Random, n_frames: int, size: tuple[int, int]) -> tuple[list[np.ndarray], int]:
    """Frames where a red square shows in a random subset of them, and the size of that subset."""
    count = rng.randint(0, n_frames)
    shown = set(rng.sample(range(n_frames), count))
    radius = 0.13 * min(size)
    frames = []
    for i in range(n_frames):
        if i in shown:
            frames.append(_frame(size, "square", RED, _random_center(rng, size, radius), radius))
        elif rng.random() < 0.5:
            frames.append(_frame(size, "circle", BLUE, _random_center(rng, size, radius), radius))
        else:
            frames.append(_frame(size))
    return frames, count


def direction_clip(rng: random.Random, n_frames: int, size: tuple[int, int]) -> tuple[list[np.ndarray], str]:
    """Frames of a green circle moving in a straight line, and the direction."""
    direction = rng.choice(DIRECTIONS)
    width, height = size
    radius = 0.12 * min(size)
    horizontal = direction in ("left", "right")
    travel = 0.45 * (width if horizontal else height)
    along_lo = radius + 1
    along_hi = (width if horizontal else height) - radius - 1 - travel
    start = rng.uniform(along_lo, along_hi)
    across = rng.uniform(radius + 1, (height if horizontal else width) - radius - 1)
    sign = 1 if direction in ("right", "down") else -1
    if sign < 0:
        start += travel
    frames = []
    for i in range(n_frames):
        along = start + sign * travel * i / max(1, n_frames - 1)
        center = (along, across) if horizontal else (across, along)
        frames.append(_frame(size, "circle", GREEN, center, radius))
    return frames, direction


def encode_mp4(frames: list[np.ndarray], fps: float) -> bytes:
    """Frames (H, W, 3 uint8, even sides) as an H.264 mp4 at `fps` frames per second."""
    import av  # the decoder's package (data/video.py) also encodes

    height, width = frames[0].shape[:2]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=_rate(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "12", "threads": "1"}
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def _rate(fps: float):
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)


def _check_args(n_frames: int, fps: float, size: tuple[int, int], question_kinds) -> None:
    width, height = size
    if width < 32 or height < 32 or width % 2 or height % 2:
        raise ValueError(f"size must be even and at least 32x32 (H.264 with 4:2:0 chroma), got {width}x{height}")
    if n_frames < 2:
        raise ValueError(f"frames must be >= 2, got {n_frames}")
    if not 0 < fps <= 120:
        raise ValueError(f"fps must be in (0, 120], got {fps}")
    unknown = [k for k in question_kinds if k not in QUESTION_KINDS]
    if unknown or not question_kinds:
        raise ValueError(f"bad question_kinds {question_kinds!r}; known kinds: {', '.join(QUESTION_KINDS)}")


def generate(
    n: int,
    seed: int,
    *,
    size: tuple[int, int] = (112, 112),
    frames: int = 8,
    fps: float = 2.0,
    question_kinds: tuple[str, ...] = QUESTION_KINDS,
) -> list[dict]:
    """`n` rows {"videos": [{"bytes", "path"}], "problem", "answer"} of `frames`-frame clips at `fps`."""
    _check_args(frames, fps, size, question_kinds)
    rows = []
    for i in range(n):
        rng = random.Random(f"video:{seed}:{i}")
        kind = rng.choice(list(question_kinds))
        if kind == "count":
            clip, answer = count_clip(rng, frames, size)
            question = COUNT_QUESTION
        else:
            clip, answer = direction_clip(rng, frames, size)
            question = DIRECTION_QUESTION
        rows.append({
            "videos": [{"bytes": encode_mp4(clip, fps), "path": f"video_{i}.mp4"}],
            "problem": f"<video>{question}",
            "answer": str(answer),
        })
    return rows
