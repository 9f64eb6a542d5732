"""A zoom-in task in DeepEyes-47k's parquet schema, and SFT trajectories that solve it with the tool.

Each canvas (448x448 by default) holds four squares, one per quadrant, each a fine checkerboard
(1-pixel checks) of one colour and its complement: red/cyan, green/magenta, blue/yellow or
white/black. One square is framed: its whole quadrant around it is black. The question asks for
the checks' colour in the framed square. Every pair averages to the same grey, and a checkerboard
(unlike stripes) still averages to it where it meets its surroundings, so once the image rule
shrinks the canvas to the model's view (data.max_pixels: 112x112 for 12544) the four squares are
the same grey (within 2 of 255 at their corners): the colour cannot be read there, while the
black quadrant is plain to see. Zooming into the framed square with `image_zoom_in_tool`
(data/zoom.py: the box is in the seen image's coordinates, the crop comes from the full-resolution
canvas) shows the checks at full resolution. Choosing the box is a choice among `places` (1, 2 or
4) fixed boxes, which a tiny model can learn.

Rows, as DeepEyes-47k (verl's RL parquet layout): `data_source`, `prompt` (chat messages: system,
then user with the question and one `<image>`), `images` (list of {bytes, path}), `ability`,
`reward_model` ({style, ground_truth}) and `extra_info` (split, index, answer, question and the
framed square's box in the seen image's coordinates, as JSON text).

With `sft=True` (`--kind zoom_sft`) each row is a trajectory in `messages` form instead: the user
turn, an assistant turn calling the tool on the framed square, the tool's answer in Qwen2.5-VL's
form (a user turn `<tool_response>` + the zoomed image + `</tool_response>`, as DeepEyes writes it),
and the final assistant answer; `images` holds the canvas and the zoomed image, in order.

Row i depends only on (seed, i).
"""

from __future__ import annotations

import functools
import io
import json
import random

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw

from data.images import smart_resize_dims
from data.zoom import zoom

# Bumped whenever the rows a (seed, options) pair gives change (tools/demo_agent.py rebuilds its data then).
VERSION = 2
TOOL_NAME = "image_zoom_in_tool"
DATA_SOURCE = "vlrl/zoom"
# The answer -> the two colours its checks alternate; each pair averages to (127.5, 127.5, 127.5). The
# four differences first - second are the corners (+-1, +-1, +-1) with an even number of minus signs, equally
# far apart, and the four names start with different tokens in the demo tokenizer (w, re, gre, b). With
# black/white named "black" (a difference of (-1, -1, -1), and "black" and "blue" sharing their first two
# tokens) the demo's SFT model told only black|blue from green|red.
CHECKS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "red": ((255, 0, 0), (0, 255, 255)),
    "green": ((0, 255, 0), (255, 0, 255)),
    "blue": ((0, 0, 255), (255, 255, 0)),
    "white": ((255, 255, 255), (0, 0, 0)),
}
BACKGROUND = (200, 200, 200)
FRAME = (0, 0, 0)
# Canvas pixels. One-pixel checks average to grey in any view shrunk 2x or more, and in a view at the
# canvas's own scale (a zoom of a 112-pixel square to 112x112) every 14-pixel patch holds the same
# whole number of periods, so the colour is the same feature in every patch the model reads.
CHECK_SIZE = 1
# Short on purpose: every token of it is in every prompt and trajectory of the CPU demo.
QUESTION = "What colour are the checks in the framed square? Zoom in, then answer in <answer> </answer>."
SYSTEM = "You are a helpful assistant."

IMAGE_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SCHEMA = pa.schema([
    ("data_source", pa.string()), ("prompt", MESSAGE_TYPE), ("images", IMAGE_TYPE), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                              ("question", pa.string()), ("bbox_2d", pa.string())])),
])
SFT_SCHEMA = pa.schema([("messages", MESSAGE_TYPE), ("images", IMAGE_TYPE), ("answer", pa.string()),
                        ("data_source", pa.string())])


def cells(size: int) -> list[tuple[int, int, int, int]]:
    """The four squares' boxes on a size x size canvas: the middle half of each quadrant."""
    q = size // 2
    return [(c * q + q // 4, r * q + q // 4, c * q + 3 * q // 4, r * q + 3 * q // 4) for r in (0, 1) for c in (0, 1)]


def seen_size(size: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) of the canvas as the model sees it under the image rule."""
    height, width = smart_resize_dims(size, size, min_pixels=min_pixels, max_pixels=max_pixels)
    return width, height


def seen_box(box: tuple[int, int, int, int], size: int, seen: tuple[int, int]) -> list[int]:
    """A canvas box in the seen image's pixel coordinates (what the model writes)."""
    sx, sy = seen[0] / size, seen[1] / size
    return [round(box[0] * sx), round(box[1] * sy), round(box[2] * sx), round(box[3] * sy)]


def draw_canvas(size: int, colours: list[str], framed: int) -> Image.Image:
    """The canvas: four checkerboards (colours[k]) and a frame around square `framed`."""
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for k, (x1, y1, x2, y2) in enumerate(cells(size)):
        pixels[y1:y2, x1:x2] = _checkerboard(colours[k], x2 - x1)
    image = Image.fromarray(pixels, "RGB")
    # The frame fills the framed square's quadrant around it: a large dark area that even an untrained
    # vision tower sees at the model's view, so learning which box to zoom is quick.
    q = size // 2
    x1, y1, x2, y2 = cells(size)[framed]
    qx, qy = (x1 // q) * q, (y1 // q) * q
    draw = ImageDraw.Draw(image)
    for box in ((qx, qy, qx + q - 1, y1 - 1), (qx, y2, qx + q - 1, qy + q - 1),
                (qx, y1, x1 - 1, y2 - 1), (x2, y1, qx + q - 1, y2 - 1)):
        draw.rectangle(box, fill=FRAME)
    return image


@functools.lru_cache(maxsize=16)
def _checkerboard(colour: str, side: int) -> np.ndarray:
    ys, xs = np.mgrid[0:side, 0:side]
    first = ((xs // CHECK_SIZE + ys // CHECK_SIZE) % 2 == 0)[..., None]
    return np.where(first, np.array(CHECKS[colour][0], np.uint8), np.array(CHECKS[colour][1], np.uint8))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def tool_call_text(box: list[int]) -> str:
    """The assistant turn that calls the zoom tool on `box` (Qwen's Hermes-style call markers)."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"bbox_2d": box}}, separators=(",", ":"))
    return "<tool_call>\n" + call + "\n</tool_call>"


# Which squares may be the framed one, for `places` = 1, 2 or 4 (the 4 squares are drawn in every case).
PLACES = {1: (3,), 2: (0, 3), 4: (0, 1, 2, 3)}


def make_row(rng: random.Random, index: int, size: int, min_pixels: int, max_pixels: int, sft: bool,
             split: str, places: int = 4) -> dict:
    colours = [rng.choice(list(CHECKS)) for _ in range(4)]
    framed = rng.choice(PLACES[places])
    answer = colours[framed]
    canvas = draw_canvas(size, colours, framed)
    seen = seen_size(size, min_pixels, max_pixels)
    box = seen_box(cells(size)[framed], size, seen)
    user = f"<image>{QUESTION}"
    images = [{"bytes": _png(canvas), "path": f"zoom_{index:06d}.png"}]
    if sft:
        seen_image = canvas.resize(seen, resample=Image.Resampling.BICUBIC)
        zoomed = zoom(seen_image, box, max_pixels, original=canvas)
        images.append({"bytes": _png(zoomed), "path": f"zoom_{index:06d}_tool.png"})
        messages = [
            {"role": "system", "content": SYSTEM},  # as the RL rows' prompt, so both render alike
            {"role": "user", "content": user},
            {"role": "assistant", "content": tool_call_text(box)},
            {"role": "user", "content": "<tool_response><image></tool_response>"},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"},
        ]
        return {"messages": messages, "images": images, "answer": answer, "data_source": DATA_SOURCE}
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "images": images,
        "ability": "zoom",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": QUESTION,
                       "bbox_2d": json.dumps(box)},
    }


def generate(n: int, seed: int, *, size: int | tuple[int, int] = 448, min_pixels: int = 3136,
             max_pixels: int = 12544, sft: bool = False, split: str = "train", places: int = 4) -> list[dict]:
    """`n` rows (DeepEyes schema, or SFT trajectories with `sft`); boxes are in the coordinates of the
    canvas as seen under min_pixels/max_pixels, so generate with the data.min/max_pixels of the run.
    `places` (1, 2 or 4) is how many squares can be the framed one: the boxes the model chooses among."""
    if places not in PLACES:
        raise ValueError(f"places must be one of {sorted(PLACES)}, got {places}")
    if isinstance(size, tuple):
        if size[0] != size[1]:
            raise ValueError(f"zoom canvases are square, got --size {size[0]}x{size[1]}")
        size = size[0]
    if size < 112 or size % 8:
        raise ValueError(f"zoom canvas size must be a multiple of 8 and at least 112, got {size}")
    seen = seen_size(size, min_pixels, max_pixels)
    if seen[0] * 2 > size:
        raise ValueError(f"a {size}x{size} canvas is seen at {seen[0]}x{seen[1]} under max_pixels={max_pixels}: "
                         f"the checks stay readable without zooming; use a canvas at least twice as large")
    return [make_row(random.Random(f"{seed}:{i}"), i, size, min_pixels, max_pixels, sft, split, places)
            for i in range(n)]


def generate_sft(n: int, seed: int, **options) -> list[dict]:
    """SFT trajectories (see the module docstring)."""
    return generate(n, seed, sft=True, **options)
