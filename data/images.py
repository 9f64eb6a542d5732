"""Image decoding and the one canonical resize that trainer and engine share.

Every image that reaches a model goes through `decode_image` (bytes or path -> RGB, with
guards against corrupt, non-image and oversized inputs) and then `canonicalize_image`
(resize to the Qwen-VL patch grid). The image processor downstream is given the already
canonical pixels and must not resize again, so the trainer and the rollout engine see
bit-identical images.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
# An encoded image larger than this is refused before it is read: 64 MB holds a 64-megapixel
# JPEG or PNG several times over, and the datasets' images are well under 1 MB.
DEFAULT_MAX_IMAGE_BYTES = 64 << 20
MAX_ASPECT_RATIO = 200

# Modes that carry an alpha channel; they are composited on white rather than having the
# alpha dropped, because dropping it turns transparent regions into arbitrary colours.
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


class BadSample(Exception):
    """A dataset row that cannot be used; `reason` is a short snake_case tag for counting."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        message = reason if not detail else f"{reason}: {detail}"
        super().__init__(message)


# Leading bytes of formats PIL reads; bytes that start like an image but fail to open are
# a damaged image, not a non-image.
_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def _looks_like_image(head: bytes) -> bool:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return any(head.startswith(sig) for sig in _SIGNATURES)


def _read_bytes(data: bytes | str | os.PathLike, max_image_bytes: int) -> tuple[bytes, str]:
    """The encoded image and a description of where it came from (for messages).

    A file's size is checked before it is read, and at most `max_image_bytes + 1` bytes are ever
    read (a file that grows meanwhile cannot make it read more)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        _check_bytes(len(data), max_image_bytes, f"{len(data)} bytes")
        return data, f"{len(data)} bytes"
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise BadSample("missing_image", f"no such file {path}")
        try:
            _check_bytes(path.stat().st_size, max_image_bytes, str(path))
            # Reading the (compressed) file whole keeps no file handle open behind the
            # returned image; a decompression bomb is small on disk.
            with path.open("rb") as f:
                encoded = f.read(max_image_bytes + 1)
        except OSError as err:
            raise BadSample("missing_image", f"cannot read {path}: {err}") from err
        _check_bytes(len(encoded), max_image_bytes, str(path))
        return encoded, str(path)
    raise TypeError(f"decode_image takes bytes or a path, got {type(data).__name__}")


def _check_bytes(size: int, max_image_bytes: int, where: str) -> None:
    if size > max_image_bytes:
        raise BadSample("image_too_large", f"{where}: {size} bytes on disk > max_image_bytes={max_image_bytes}")


def _open(encoded: bytes, where: str) -> Image.Image:
    """Open lazily (header only), mapping failures to BadSample."""
    if not encoded:
        raise BadSample("not_an_image", f"{where}: empty")
    try:
        # PIL warns (and past 2x its global limit, raises) on very large headers; our own
        # check is the one that decides, so the warning is noise here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(encoded))
    except Image.DecompressionBombError as err:
        raise BadSample("image_too_large", f"{where}: {err}") from err
    except UnidentifiedImageError as err:
        if _looks_like_image(encoded[:16]):
            raise BadSample("corrupt_image", f"{where} has an image signature but does not parse") from err
        raise BadSample("not_an_image", f"{where} is not a readable image") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise BadSample("corrupt_image", f"{where}: {err}") from err


def _check_header_size(img: Image.Image, max_image_pixels: int, where: str) -> None:
    """Reject oversized images from the header alone, before any pixel is decoded."""
    width, height = img.size
    if width <= 0 or height <= 0:
        raise BadSample("corrupt_image", f"{where}: image header says {width}x{height}")
    if width * height > max_image_pixels:
        raise BadSample(
            "image_too_large",
            f"{where}: {width}x{height} = {width * height} pixels > max_image_pixels={max_image_pixels}",
        )


def _sixteen_bit_to_l(img: Image.Image) -> Image.Image:
    """Scale 16/32-bit grey to 8 bits; PIL's own convert clips everything above 255 to white."""
    arr = np.asarray(img, dtype=np.float64)
    if img.mode in _SIXTEEN_BIT_MODES or arr.max(initial=0) > 255:
        arr = arr * (255.0 / 65535.0)
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; transparent pixels become white."""
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT_MODES or img.mode in ("I", "F"):
        return _sixteen_bit_to_l(img).convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    try:
        return img.convert("RGB")
    except ValueError as err:
        raise BadSample("unsupported_mode", f"cannot convert mode {img.mode} to RGB") from err


def decode_image(
    data: bytes | str | os.PathLike, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
) -> Image.Image:
    """Decode image bytes or a file into a fully loaded RGB PIL image.

    Raises BadSample with reason:
      - "missing_image": the path does not exist;
      - "not_an_image": empty bytes or bytes no image format recognises;
      - "image_too_large": the encoded image (a file's size, checked before reading it) is over
        `max_image_bytes`, or width*height from the header exceeds `max_image_pixels`
        (checked before decoding, so a decompression bomb costs nothing); PIL's own hard
        limit (twice `PIL.Image.MAX_IMAGE_PIXELS`) is reported the same way;
      - "corrupt_image": the header parses but the pixel data does not (e.g. truncated).
    Modes L, LA, P, PA, RGBA, CMYK, 1, I, I;16 and F all come back as RGB; alpha is
    composited on white. EXIF orientation is not applied (the public datasets and the
    Hugging Face image processors do not apply it either).
    """
    encoded, where = _read_bytes(data, max_image_bytes)
    img = _open(encoded, where)
    _check_header_size(img, max_image_pixels, where)
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise BadSample("corrupt_image", f"{where}: pixel data failed to decode: {err}") from err
    return to_rgb(img)


def smart_resize_dims(
    height: int, width: int, *, factor: int = 28, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (height, width) for an image under the Qwen2-VL resize rule.

    Each side is rounded to a multiple of `factor` (at least `factor`); if the area then
    exceeds `max_pixels` both sides are scaled down by the same ratio and floored to the
    factor, if it is below `min_pixels` they are scaled up and ceiled. A canonical size is
    a fixed point of this rule, so a processor that applies it again leaves it unchanged.
    One deviation: for very thin images whose short side is clamped to `factor`, the long
    side is shortened so the area never exceeds `max_pixels`.
    Tiny images (even 1x1) are scaled up to the minimum grid rather than rejected.
    Aspect ratios above 200 raise BadSample("bad_aspect_ratio").
    """
    if height <= 0 or width <= 0:
        raise BadSample("corrupt_image", f"image size {width}x{height}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} is larger than max_pixels={max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadSample(
            "bad_aspect_ratio",
            f"{width}x{height} has aspect ratio above {MAX_ASPECT_RATIO}",
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
        h_bar, w_bar = _fit_thin(h_bar, w_bar, factor, max_pixels)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _fit_thin(h_bar: int, w_bar: int, factor: int, max_pixels: int) -> tuple[int, int]:
    # When the short side was clamped up to `factor`, the area can still exceed
    # max_pixels; shorten the long side so the result stays within bounds (the plain
    # Qwen2-VL rule overshoots here; our output is still a fixed point of that rule).
    if h_bar * w_bar <= max_pixels:
        return h_bar, w_bar
    if h_bar <= w_bar:
        return h_bar, max(factor, max_pixels // h_bar // factor * factor)
    return max(factor, max_pixels // w_bar // factor * factor), w_bar


def canonicalize_image(
    img: Image.Image, *, min_pixels: int, max_pixels: int, factor: int = 28
) -> Image.Image:
    """Return `img` as RGB at its smart_resize_dims size (BICUBIC); the final pixels models see."""
    img = to_rgb(img)
    height, width = smart_resize_dims(
        img.height, img.width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    if (width, height) == img.size:
        return img
    return img.resize((width, height), resample=Image.Resampling.BICUBIC)


def _content_hasher():
    """blake3 where vLLM is installed (its own image hash), else blake2b: both are fast on megabytes."""
    try:
        from blake3 import blake3

        return blake3()
    except ImportError:
        return hashlib.blake2b(digest_size=32)


def image_key(image) -> str:
    """A content key for one PIL image: its mode, size, palette and pixel bytes (a 256-bit hash). The vLLM
    engine sends it as the image's `multi_modal_uuids` entry in place of vLLM hashing the image itself (its
    processor arguments are fixed for its lifetime, so content alone names the processed result); the tool
    messages of a turn share one processor call per content (`rollout.episode.ToolResultEncoder`)."""
    hasher = _content_hasher()
    hasher.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette:
        hasher.update(bytes(palette))
    hasher.update(image.tobytes())
    return f"vlrl-image-{hasher.hexdigest()}"
