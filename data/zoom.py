"""The zoom rule: a box of the image the model saw, cut from the best copy of that image and enlarged.

Shared by the `image_zoom_in_tool` (rollout/tools.py) and the zoom data generator
(data/generators/zoom.py), so that the tool results in SFT trajectories are exactly what the tool
returns during rollouts.

The box is in pixel coordinates of the image as the model saw it (after the image rule shrank it
to data.max_pixels). When the caller also has the image at a higher resolution (the `original`
the dataset held), the crop is cut from that, so zooming in shows detail the model's view had lost.
The crop is then resized to the largest size with its aspect ratio and at most `max_pixels` pixels.
"""

from __future__ import annotations

import math

from PIL import Image

MIN_BOX_SIDE = 4  # pixels of the seen image; a thinner box is degenerate
MIN_ZOOM_SIDE = 28  # the enlarged crop's short side (one 28-pixel patch group) must reach this


class BadBox(ValueError):
    """A box the zoom rule refuses; the message says why in one line."""


def check_box(box, width: int, height: int) -> tuple[int, int, int, int]:
    """The integer box [x1, y1, x2, y2] inside a width x height image, or BadBox naming what is wrong."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise BadBox(f"bbox_2d must be a list [x1, y1, x2, y2], got {str(box)[:60]}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box):
        raise BadBox(f"bbox_2d must hold 4 finite numbers, got {str(box)[:60]}")
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    if x1 < 0 or y1 < 0 or x2 > width or y2 > height:
        raise BadBox(f"bbox_2d {[x1, y1, x2, y2]} is outside the image (0, 0, {width}, {height})")
    if x2 - x1 < MIN_BOX_SIDE or y2 - y1 < MIN_BOX_SIDE:
        raise BadBox(f"bbox_2d {[x1, y1, x2, y2]} is degenerate: need x2 - x1 and y2 - y1 >= {MIN_BOX_SIDE}")
    return x1, y1, x2, y2


def enlarged_size(width: float, height: float, max_pixels: int) -> tuple[int, int]:
    """The largest size with the aspect ratio of width x height and at most max_pixels pixels; a box
    too thin for that size to keep a MIN_ZOOM_SIDE short side is refused (the image rule would have
    to stretch it past the pixel limit)."""
    scale = math.sqrt(max_pixels / (width * height))
    out_w, out_h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    while out_w * out_h > max_pixels:  # float rounding
        out_w, out_h = max(1, out_w - 1), max(1, out_h - 1)
    if min(out_w, out_h) < MIN_ZOOM_SIDE:
        raise BadBox(f"bbox_2d of {round(width)}x{round(height)} pixels is too thin: enlarged to the "
                     f"{max_pixels}-pixel limit its short side is under {MIN_ZOOM_SIDE}")
    return out_w, out_h


def zoom(seen: Image.Image, box, max_pixels: int, original: Image.Image | None = None) -> Image.Image:
    """The region `box` of `seen` (pixel coordinates of `seen`), cut from `original` when given (the
    same picture at another resolution) and resized to at most max_pixels; RGB."""
    x1, y1, x2, y2 = check_box(box, seen.width, seen.height)
    source = seen if original is None else original
    sx, sy = source.width / seen.width, source.height / seen.height
    crop_box = (x1 * sx, y1 * sy, x2 * sx, y2 * sy)
    out_w, out_h = enlarged_size(crop_box[2] - crop_box[0], crop_box[3] - crop_box[1], max_pixels)
    source = source if source.mode == "RGB" else source.convert("RGB")
    # resize's box argument crops and scales in one step, at sub-pixel precision
    return source.resize((out_w, out_h), resample=Image.Resampling.BICUBIC, box=crop_box)
