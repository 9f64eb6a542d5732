"""Vision-language datasets read from disk in the public schemas.

Accepted files:
  - parquet as published for hiyouga/geometry3k and BUAADreamer/clevr_count_70k:
    `images` is a list of {bytes, path} structs, `problem` holds the question with one
    `<image>` tag per image, `answer` the gold answer. `images` may also be a single
    {bytes, path} struct, a list of path strings, or one path string;
  - JSONL, one object per line with the same keys; image paths are absolute or relative
    to the JSONL file's folder (relative parquet paths resolve against the parquet's folder);
  - a .json file holding one array of such objects (Video-R1's files).

Videos (data/video.py decodes them): a `videos` column (alias `video`) beside or instead of
`images`, each cell a path, a {bytes, path} struct, or a list of those or of frame lists; the
problem gets one `<video>` tag per video. Video-R1's rows name their one video or image `path`
with `data_type` saying which, and a non-empty `options` list is added to the problem. Bad videos
are BadSamples too (bad_video, no_video_stream, empty_video, missing_video, video_too_large,
video_too_long, video_count_mismatch, too_many_videos).

Column aliases: some public files name the columns differently, so `question` is read as
`problem`, `solution` as `answer`, `image` as `images` and `video` as `videos` when the canonical
name is absent.
A gold answer wrapped whole in `<answer> ... </answer>` (as in the CLEVR CoGenT files) is
unwrapped. A problem with no `<image>` tag but with images gets the images before its text.

Images stay encoded in the arrow table and are decoded per access, so host memory does not
grow with the dataset's pixel count. A bad row raises BadSample from `get` and is skipped
and counted by `iter_samples`. A cell of the wrong type (`images` as a number, an image's
`bytes` as a number, ...) makes its row "wrong_type". `VLDataset.bound_rows` bounds the number of
images and the problem's and answer's length; rows over the bounds are skipped ("too_many_images",
"prompt_too_long", "answer_too_long") before any image is decoded; an images cell's count and
each image's encoded size (`max_image_bytes`) are read from arrow before the cell is converted.
Text that is not valid UTF-8 (a JSONL line, or a parquet text column stored as binary) makes its
row "invalid_text"; it does not fail the file.

CLI: python -m data.datasets inspect FILE --task T [--model DIR] [--max-rows N]
prints one JSON object (rows, loaded, skipped, skip_reasons, first_prompt). With --model
the prompt goes through the folder's chat template (AutoProcessor, or the folder's
tokenizer when the processor cannot be built, e.g. without torchvision).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from data.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, BadSample, canonicalize_image, decode_image
from data.prompts import IMAGE_TAG, build_messages, check_task, render_messages_plain
from data.trajectories import MessageRows, messages_layout
from data.video import (DEFAULT_MAX_FRAMES, DEFAULT_MAX_SOURCE_FRAMES, DEFAULT_MAX_VIDEO_BYTES, DEFAULT_VIDEO_FPS,
                        DEFAULT_VIDEO_MAX_PIXELS, VIDEO_TAG, Video, check_video_options, decode_video)

logger = logging.getLogger(__name__)

# Canonical column name -> names accepted for it, in order of preference.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "images": ("images", "image"),
    "videos": ("videos", "video"),
    "problem": ("problem", "question"),
    "answer": ("answer", "solution"),
}
# A row needs one of these (or Video-R1's `path` with `data_type`), not all of them.
MEDIA_COLUMNS = ("images", "videos")

_WRAPPED_ANSWER = re.compile(r"^\s*<answer>(.*)</answer>\s*$", re.DOTALL)
INVALID_TEXT_COLUMN = "__invalid_text__"  # set by the JSONL reader on rows it could not decode


@dataclass
class Sample:
    """One usable row: canonical RGB images and decoded videos, and a problem with one `<image>` tag per
    image and one `<video>` tag per video."""

    index: int
    images: list[Image.Image]
    problem: str
    answer: str
    videos: list = field(default_factory=list)  # data.video.Video, one per <video> tag


class SkipStats:
    """Counts skipped rows by reason and logs one warning line per skip."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def record(self, index: int, reason: str, path: str | Path, detail: str = "") -> None:
        """Count one skipped row and log where it was and why."""
        self.counts[reason] += 1
        suffix = f" ({detail})" if detail else ""
        logger.warning("skipping row %d of %s: %s%s", index, path, reason, suffix)

    @property
    def total(self) -> int:
        """Number of rows skipped so far."""
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """Reason -> number of skipped rows, sorted by reason."""
        return dict(sorted(self.counts.items()))


def _read_jsonl(path: Path) -> pa.Table:
    """Read a JSONL file into an arrow table; a malformed line fails with its line number.

    A line that is not valid UTF-8 (or whose JSON escapes make a lone surrogate) is kept as an
    empty row whose `INVALID_TEXT_COLUMN` cell says why, so `VLDataset.get` skips and counts it
    as "invalid_text" instead of one bad line failing the whole file.
    """
    rows: list[dict] = []
    invalid: dict[int, str] = {}
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                invalid[len(rows)] = f"{path}:{line_no}: not valid UTF-8 (byte {raw[err.start]:#04x} at offset {err.start})"
                rows.append({})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            if not _encodable(row):
                invalid[len(rows)] = f"{path}:{line_no}: text with a lone surrogate escape (not valid Unicode)"
                row = {}
            rows.append(row)
    return _rows_table(rows, invalid)


def _read_json_array(path: Path) -> pa.Table:
    """Read a .json file holding one array of row objects (as Video-R1's files are)."""
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a valid JSON array of rows ({err})") from err
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of row objects, got {type(rows).__name__}")
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {index} is {type(row).__name__}; expected a JSON object")
    invalid = {index: f"{path}: row {index}: text with a lone surrogate escape (not valid Unicode)"
               for index, row in enumerate(rows) if not _encodable(row)}
    return _rows_table([{} if index in invalid else row for index, row in enumerate(rows)], invalid)


def _rows_table(rows: list[dict], invalid: dict[int, str]) -> pa.Table:
    """Decoded JSON rows as an arrow table: image cells as path lists, video cells as {path, frames} lists."""
    names = sorted({key for row in rows for key in row})
    columns = {name: [row.get(name) for row in rows] for name in names}
    for name in COLUMN_ALIASES["images"]:
        if name in columns:
            columns[name] = [_jsonl_image_paths(value) for value in columns[name]]
    for name in COLUMN_ALIASES["videos"]:
        if name in columns:
            columns[name] = pa.array([_jsonl_video_entries(value) for value in columns[name]], type=VIDEO_ENTRIES)
    arrays = {name: _jsonl_column(values) for name, values in columns.items()}
    if invalid:
        arrays[INVALID_TEXT_COLUMN] = pa.array([invalid.get(i) for i in range(len(rows))], type=pa.string())
    return pa.table(arrays)


def _encodable(value: Any) -> bool:
    """Whether every string inside a decoded JSON value can be written as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


def _jsonl_image_paths(value: Any) -> list[str | None]:
    """A JSONL images cell as a list of paths; an unusable entry becomes None (skipped later)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    paths: list[str | None] = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("path")
        paths.append(item if isinstance(item, str) else None)
    return paths


# A JSON videos cell: each video is a file path or a list of frame paths.
VIDEO_ENTRIES = pa.list_(pa.struct([("path", pa.string()), ("frames", pa.list_(pa.string()))]))


def _jsonl_video_entries(value: Any) -> list[dict]:
    """A JSON videos cell (a path, a {path} object, or a list of those or of frame-path lists) as
    {path, frames} entries; an unusable entry has neither (skipped later as missing_video)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]  # a list of paths is one video per path
    entries = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("path")
        if isinstance(item, list):
            entries.append({"path": None, "frames": [v if isinstance(v, str) else None for v in item]})
        else:
            entries.append({"path": item if isinstance(item, str) else None, "frames": None})
    return entries


def _jsonl_column(values: list) -> pa.Array:
    """One JSONL column as arrow; rows that mix types (3 and "3") are stored as strings."""
    if isinstance(values, pa.Array):
        return values
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values])


def read_table(path: str | Path) -> pa.Table:
    """Read a parquet (.parquet) or JSONL (.jsonl/.json) file as an arrow table."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path, memory_map=True)
    if suffix == ".json" and _starts_with(path, b"["):
        return _read_json_array(path)
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise ValueError(f"{path}: unsupported dataset format {suffix!r}; use .parquet or .jsonl")


def _starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file's first non-whitespace bytes are `prefix`."""
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(prefix)


def resolve_columns(table: pa.Table, path: str | Path) -> dict[str, str]:
    """Map each canonical column to the name it has in `table`, or raise naming what is missing.

    `images` and `videos` are each optional, but a file needs one of them, or Video-R1's `path`
    and `data_type` columns (`path` is the row's video or image, as `data_type` says)."""
    present = table.column_names
    resolved = {}
    for canonical, aliases in COLUMN_ALIASES.items():
        found = next((name for name in aliases if name in present), None)
        if found is None and canonical in MEDIA_COLUMNS:
            continue
        if found is None:
            also = f" (also accepted: {', '.join(repr(a) for a in aliases[1:])})" if len(aliases) > 1 else ""
            raise ValueError(
                f"{path}: missing required column {canonical!r}{also}; columns present: {present}"
            )
        resolved[canonical] = found
    if not any(name in resolved for name in MEDIA_COLUMNS) and not {"path", "data_type"} <= set(present):
        raise ValueError(f"{path}: missing required column 'images' (also accepted: 'image'), or 'videos' (also "
                         f"accepted: 'video'), or Video-R1's 'path' with 'data_type'; columns present: {present}")
    return resolved


def _image_refs(value: Any) -> list[tuple[bytes | None, str | None]]:
    """Normalise an images cell to a list of (bytes, path) pairs; a cell of the wrong type is a BadSample."""
    if value is None:
        return []
    if isinstance(value, (dict, str, bytes)):
        value = [value]
    if not isinstance(value, list):
        raise BadSample("wrong_type", f"images is {type(value).__name__}; expected a list of {{bytes, path}} "
                                      "structs, one such struct, or path strings")
    refs = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            data, path = item.get("bytes"), item.get("path")
            if not isinstance(data, (bytes, type(None))):
                raise BadSample("wrong_type", f"images[{i}].bytes is {type(data).__name__}; expected binary")
            if not isinstance(path, (str, type(None))):
                raise BadSample("wrong_type", f"images[{i}].path is {type(path).__name__}; expected a string")
            refs.append((data, path))
        elif isinstance(item, str):
            refs.append((None, item))
        elif isinstance(item, bytes):
            refs.append((item, None))
        elif item is None:
            refs.append((None, None))
        else:
            raise BadSample("wrong_type", f"images[{i}] is {type(item).__name__}; expected a {{bytes, path}} "
                                          "struct or a path string")
    return refs


def _images_type_problem(kind: pa.DataType) -> str | None:
    """What is wrong with an images column of arrow type `kind` (None when every row can be read)."""
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
    if pa.types.is_dictionary(item):
        item = item.value_type
    binary = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_null)
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_null)
    if any(check(item) for check in binary + text):
        return None
    if not pa.types.is_struct(item):
        return (f"images has arrow type {kind}; expected a list of {{bytes, path}} structs, one such struct, "
                "or path strings")
    for name, allowed, want in (("bytes", binary, "binary"), ("path", text, "a string")):
        index = item.get_field_index(name)
        if index >= 0 and not any(check(item.field(index).type) for check in allowed):
            return f"images' {name} field has arrow type {item.field(index).type}; expected {want}"
    return None


def _check_length(text: str, field: str, max_chars: int | None, reason: str) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise BadSample(reason, f"{field} has {len(text)} characters > {max_chars} (data.max_prompt_tokens × the "
                                "longest token's characters); checked before tokenizing")


def _decoded(value: Any, field: str) -> Any:
    """A text cell stored as binary (some parquet writers do) as str; not valid UTF-8 → BadSample."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadSample("invalid_text", f"{field} is not valid UTF-8 (byte {value[err.start]:#04x} at offset "
                                        f"{err.start})") from err


def _answer_text(value: Any, max_chars: int | None = None) -> str:
    """The gold answer as a non-empty string, unwrapped from <answer> tags if needed."""
    value = _decoded(value, "answer")
    if value is None:
        raise BadSample("missing_answer", "answer is None")
    if isinstance(value, bool):
        raise BadSample("wrong_type", f"answer is {value!r}; expected text or a number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if not isinstance(value, str):
        raise BadSample("wrong_type", f"answer is {type(value).__name__}; expected text or a number")
    _check_length(value, "answer", max_chars, "answer_too_long")
    wrapped = _WRAPPED_ANSWER.match(value)
    text = (wrapped.group(1) if wrapped else value).strip()
    if not text:
        raise BadSample("missing_answer", "answer is empty")
    return text


def _problem_text(value: Any, n_images: int, max_chars: int | None = None) -> str:
    """The problem with exactly one <image> tag per image (tags prepended if it has none)."""
    value = _decoded(value, "problem")
    if value is not None and not isinstance(value, str):
        raise BadSample("wrong_type", f"problem is {type(value).__name__}; expected text")
    if isinstance(value, str):
        _check_length(value, "problem", max_chars, "prompt_too_long")
    if not isinstance(value, str) or not value.replace(IMAGE_TAG, "").replace(VIDEO_TAG, "").strip():
        raise BadSample("empty_problem", f"problem is {value!r}")
    n_tags = value.count(IMAGE_TAG)
    if n_tags == 0 and n_images > 0:
        return IMAGE_TAG * n_images + value
    if n_tags != n_images:
        raise BadSample("image_count_mismatch", f"{n_tags} {IMAGE_TAG} tags, {n_images} images")
    return value


def _video_tags(problem: str, n_videos: int) -> str:
    """The problem with exactly one <video> tag per video (tags prepended if it has none)."""
    n_tags = problem.count(VIDEO_TAG)
    if n_tags == 0 and n_videos > 0:
        return VIDEO_TAG * n_videos + problem
    if n_tags != n_videos:
        raise BadSample("video_count_mismatch", f"{n_tags} {VIDEO_TAG} tags, {n_videos} videos")
    return problem


def _with_options(problem: Any, options: Any) -> Any:
    """Video-R1's multiple-choice rows keep their choices in `options` ("A. ...", ...): they follow the problem."""
    if not isinstance(problem, str) or not isinstance(options, list) or not options:
        return problem
    if not all(isinstance(option, str) for option in options):
        raise BadSample("wrong_type", "options holds a non-text entry; expected strings such as 'A. red'")
    return problem + "\nOptions:\n" + "\n".join(options)


def _video_refs(value: Any) -> list:
    """Normalise a videos cell to one source per video: bytes, a path, or a list of frames (bytes or paths).

    A cell is a path string, one {bytes, path} struct, or a list of those, of bytes, or of frame lists
    (each frame a path, bytes or a {bytes, path} struct); a {path, frames} struct is one video given
    either way. A cell of the wrong type is a BadSample."""
    if value is None:
        return []
    if isinstance(value, (dict, str, bytes)):
        value = [value]
    if not isinstance(value, list):
        raise BadSample("wrong_type", f"videos is {type(value).__name__}; expected a path, a {{bytes, path}} struct, "
                                      "or a list of those or of frame lists")
    return [_video_ref(item, f"videos[{i}]") for i, item in enumerate(value)]


def _video_ref(item: Any, where: str) -> Any:
    if isinstance(item, dict):
        data, path, frames = item.get("bytes"), item.get("path"), item.get("frames")
        if data:
            return _media_value(data, where)
        if frames:
            return _video_ref(frames, where)
        return _media_value(path, where)
    if isinstance(item, list):
        frames = [_media_value(f.get("bytes") or f.get("path") if isinstance(f, dict) else f, f"{where}[{j}]")
                  for j, f in enumerate(item)]
        return frames
    return _media_value(item, where)


def _media_value(value: Any, where: str) -> bytes | str | None:
    if value is None or isinstance(value, (bytes, str)):
        return value
    raise BadSample("wrong_type", f"{where} is {type(value).__name__}; expected bytes or a path string")


def video_kwargs(data_cfg: Any) -> dict:
    """VLDataset's video keyword arguments from a config's data section (grpo.config.DataConfig)."""
    return {name: getattr(data_cfg, name) for name in
            ("video_fps", "max_frames", "video_max_pixels", "max_video_bytes", "max_source_frames")}


class VLDataset:
    """Rows of a parquet/JSONL file, decoded and canonicalized one at a time on access."""

    def __init__(
        self,
        path: str | Path,
        task: str,
        *,
        min_pixels: int = 28 * 28,
        max_pixels: int = 512 * 28 * 28,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_images: int | None = None,
        max_text_chars: int | None = None,
        video_fps: float = DEFAULT_VIDEO_FPS,
        max_frames: int = DEFAULT_MAX_FRAMES,
        video_max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS,
        max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
        max_source_frames: int = DEFAULT_MAX_SOURCE_FRAMES,
        video_factor: int = 28,
        frame_multiple: int = 2,
    ):
        if min_pixels > max_pixels:
            raise ValueError(f"min_pixels={min_pixels} is larger than max_pixels={max_pixels}")
        # data/video.py's decode_video arguments; the family's factor and temporal patch where it is known
        self.video_options = dict(fps=video_fps, max_frames=max_frames, video_max_pixels=video_max_pixels,
                                  max_bytes=max_video_bytes, max_source_frames=max_source_frames, factor=video_factor,
                                  frame_multiple=frame_multiple, min_pixels=min_pixels, max_pixels=max_pixels,
                                  max_frame_pixels=max_image_pixels)
        check_video_options(**{k: v for k, v in self.video_options.items()
                               if k not in ("max_bytes", "max_source_frames", "max_frame_pixels")})
        self.path = Path(path)
        self.task = check_task(task)
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.max_image_pixels = max_image_pixels
        self.max_image_bytes = max_image_bytes
        self.max_images: int | None = None
        self.max_text_chars: int | None = None
        self.bound_rows(max_images, max_text_chars)
        self._table = read_table(self.path)
        # DeepEyes-style `prompt` rows and `messages` trajectories are read by data/trajectories.py
        layout = messages_layout(self._table)
        self._messages = MessageRows(self._table, layout, self.path) if layout else None
        self._columns = resolve_columns(self._table, self.path) if layout is None else {}
        self._images_column = self._columns.get("images", "images")
        self._images_problem = (_images_type_problem(self._table.schema.field(self._images_column).type)
                                if self._images_column in self._table.column_names else None)
        self._base_dir = self.path.resolve().parent

    def __len__(self) -> int:
        return self._table.num_rows

    def bound_rows(self, max_images: int | None = None, max_text_chars: int | None = None) -> None:
        """Skip rows with more images, or a longer problem or answer, than this (None: no bound).

        Checked in `get` before any image is decoded and before the images cell is converted, so
        a row's cost is bounded by these before any expensive work; a bound only ever tightens.
        """
        for name, value in (("max_images", max_images), ("max_text_chars", max_text_chars)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
                current = getattr(self, name)
                setattr(self, name, value if current is None else min(current, value))

    def _cell(self, canonical: str, index: int) -> Any:
        return self._table.column(self._columns[canonical])[index].as_py()

    def _check_image_cell(self, index: int) -> None:
        """The images cell's count and encoded sizes, read from arrow before it is converted.

        Converting copies every image's bytes out of the table at once; a row listing millions
        of entries, or holding an image over `max_image_bytes`, is refused before that copy.
        """
        if self._images_problem and self._messages is not None:
            # data/trajectories.py reads such rows' images without checking each value's type
            raise BadSample("wrong_type", self._images_problem)
        if self._images_column not in self._table.column_names:
            return
        scalar = self._table.column(self._images_column)[index]
        if not isinstance(scalar, (pa.ListScalar, pa.LargeListScalar)) or not scalar.is_valid:
            return
        values = scalar.values
        if self.max_images is not None and len(values) > self.max_images:
            raise BadSample("too_many_images", f"{len(values)} images > {self.max_images} (each image takes at least "
                                               "one token of data.max_prompt_tokens)")
        if pa.types.is_struct(values.type) and values.type.get_field_index("bytes") >= 0:
            values = values.field("bytes")
        if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
            largest = pc.max(pc.binary_length(values)).as_py() if len(values) else None
            if largest is not None and largest > self.max_image_bytes:
                raise BadSample("image_too_large", f"an image of {largest} bytes > max_image_bytes="
                                                   f"{self.max_image_bytes}")

    def _check_video_cell(self, index: int) -> None:
        """The videos cell's count and encoded sizes, read from arrow before its bytes are copied out."""
        if "videos" not in self._columns:
            return
        scalar = self._table.column(self._columns["videos"])[index]
        if not isinstance(scalar, (pa.ListScalar, pa.LargeListScalar)) or not scalar.is_valid:
            return
        values = scalar.values
        if self.max_images is not None and len(values) > self.max_images:
            raise BadSample("too_many_videos", f"{len(values)} videos > {self.max_images} (each video takes at least "
                                               "one token of data.max_prompt_tokens)")
        if pa.types.is_struct(values.type) and values.type.get_field_index("bytes") >= 0:
            values = values.field("bytes")
        if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
            largest = pc.max(pc.binary_length(values)).as_py() if len(values) else None
            limit = self.video_options["max_bytes"]
            if largest is not None and largest > limit:
                raise BadSample("video_too_large", f"a video of {largest} bytes > max_video_bytes={limit}")

    def _media_cells(self, index: int) -> tuple[Any, Any]:
        """The row's images and videos cells; for Video-R1 rows, `path` is one or the other as `data_type` says."""
        if any(name in self._columns for name in MEDIA_COLUMNS):
            return tuple(self._cell(name, index) if name in self._columns else None for name in MEDIA_COLUMNS)
        kind = _decoded(self._table.column("data_type")[index].as_py(), "data_type")
        path = self._table.column("path")[index].as_py()
        if kind in ("video", "image") and not path:
            raise BadSample(f"missing_{kind}", f"path is {path!r}")
        if kind == "video":
            return None, path
        if kind == "image":
            return path, None
        raise BadSample("wrong_type", f"data_type is {kind!r}; expected 'video' or 'image' (Video-R1's schema)")

    def _problem_cell(self, index: int) -> Any:
        problem = self._cell("problem", index)
        if "options" in self._table.column_names:
            problem = _with_options(_decoded(problem, "problem"), self._table.column("options")[index].as_py())
        return problem

    def _load_video(self, ref: Any, where: str) -> Video:
        if ref is None or (isinstance(ref, list) and any(frame is None for frame in ref)):
            raise BadSample("missing_video", f"{where} has neither bytes nor path")
        if isinstance(ref, list):
            ref = [self._local(frame) if isinstance(frame, str) else frame for frame in ref]
        elif isinstance(ref, str):
            ref = self._local(ref)
        return decode_video(ref, where=where if isinstance(ref, (bytes, list)) else "", **self.video_options)

    def _local(self, path: str) -> Path:
        return Path(path) if Path(path).is_absolute() else self._base_dir / path

    def _check_text_cells(self, index: int) -> None:
        """The problem's (or conversation's) and the answer's stored size, read before they are converted.

        UTF-8 takes at most 4 bytes a character, so a cell of more than 4 × max_text_chars bytes
        (plus a little for a nested cell's offsets) holds more characters than any prompt can.
        """
        if self.max_text_chars is None:
            return
        if self._messages is None:
            cells = [(self._columns["problem"], "prompt_too_long"), (self._columns["answer"], "answer_too_long")]
        else:
            cells = [(self._messages.layout, "prompt_too_long")]
            cells += [("answer", "answer_too_long")] if "answer" in self._table.column_names else []
        limit = 4 * self.max_text_chars + 4096
        for name, reason in cells:
            column = self._table.column(name)
            kind = column.type
            if any(check(kind) for check in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                              pa.types.is_large_binary)):
                size = pc.max(pc.binary_length(column.slice(index, 1))).as_py() or 0
            elif pa.types.is_nested(kind):
                size = column.slice(index, 1).nbytes  # the slice's own share of the buffers
            else:  # numbers are small; a dictionary's values are shared by every row (checked once converted)
                continue
            if size > limit:
                raise BadSample(reason, f"{name} holds {size} bytes, more than {self.max_text_chars} characters "
                                        "(data.max_prompt_tokens × the longest token's characters) can take")

    def _load_image(self, data: bytes | None, path: str | None) -> Image.Image:
        if data:
            img = decode_image(data, max_image_pixels=self.max_image_pixels, max_image_bytes=self.max_image_bytes)
        elif path:
            full = Path(path) if Path(path).is_absolute() else self._base_dir / path
            img = decode_image(full, max_image_pixels=self.max_image_pixels, max_image_bytes=self.max_image_bytes)
        else:
            raise BadSample("missing_image", "image entry has neither bytes nor path")
        return canonicalize_image(img, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def get(self, index: int) -> Sample:
        """Row `index` as a Sample; raises BadSample (with a reason) if the row is unusable."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {self.path} with {len(self)} rows")
        if INVALID_TEXT_COLUMN in self._table.column_names:
            invalid = self._table.column(INVALID_TEXT_COLUMN)[index].as_py()
            if invalid:
                raise BadSample("invalid_text", invalid)
        self._check_image_cell(index)
        self._check_video_cell(index)
        self._check_text_cells(index)
        if self._messages is not None:
            return self._messages.get(index, self)
        images_cell, videos_cell = self._media_cells(index)
        refs = _image_refs(images_cell)
        video_refs = _video_refs(videos_cell)
        if self.max_images is not None and len(refs) > self.max_images:
            raise BadSample("too_many_images", f"{len(refs)} images > {self.max_images}")
        if self.max_images is not None and len(video_refs) > self.max_images:
            raise BadSample("too_many_videos", f"{len(video_refs)} videos > {self.max_images}")
        # Sizes and text fields first: they are cheap to check and save decoding a doomed row's images.
        problem = _problem_text(self._problem_cell(index), len(refs), self.max_text_chars)
        problem = _video_tags(problem, len(video_refs))
        answer = _answer_text(self._cell("answer", index), self.max_text_chars)
        images = [self._load_image(data, path) for data, path in refs]
        videos = [self._load_video(ref, f"videos[{i}] of row {index}") for i, ref in enumerate(video_refs)]
        return Sample(index=index, images=images, problem=problem, answer=answer, videos=videos)

    def iter_samples(self, indices: Iterable[int], stats: SkipStats) -> Iterator[Sample]:
        """Yield the good samples among `indices`, recording each bad one in `stats`."""
        for index in indices:
            try:
                yield self.get(index)
            except BadSample as bad:
                stats.record(index, bad.reason, self.path, bad.detail)


def _load_template_owner(model_dir: str):
    """The model folder's processor, or its tokenizer when the processor cannot be built.

    A Qwen-VL processor also builds a video processor that needs torchvision; rendering
    the prompt text needs only the chat template, which the tokenizer carries as well.
    """
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model must be a local folder, got {model_dir}")
    from transformers import AutoProcessor, AutoTokenizer  # only the CLI needs transformers

    try:
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except (ImportError, OSError, ValueError, AttributeError) as err:
        logger.warning("AutoProcessor failed for %s (%s); using its tokenizer's chat template",
                       model_dir, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _render_prompt(sample: Sample, task: str, model_dir: str | None) -> str:
    """The prompt text the model sees: its chat template if a model folder is given."""
    messages = build_messages(sample, task)
    if model_dir is None:
        return render_messages_plain(messages)
    owner = _load_template_owner(model_dir)
    text = owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text[0] if isinstance(text, list) else text


def inspect_file(path: str, task: str, model_dir: str | None = None, max_rows: int | None = None) -> dict:
    """Load (up to `max_rows` of) a dataset file and summarise rows, skips and the first prompt."""
    dataset = VLDataset(path, task)
    stats = SkipStats()
    scanned = len(dataset) if max_rows is None else min(max_rows, len(dataset))
    loaded, first = 0, None
    for sample in dataset.iter_samples(range(scanned), stats):
        loaded += 1
        if first is None:
            first = sample
    return {
        "file": str(path),
        "task": task,
        "rows": len(dataset),
        "scanned": scanned,
        "loaded": loaded,
        "skipped": stats.total,
        "skip_reasons": stats.as_dict(),
        "first_prompt": _render_prompt(first, task, model_dir) if first is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m data.datasets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="load a file and print one JSON summary line")
    inspect.add_argument("file")
    inspect.add_argument("--task", required=True)
    inspect.add_argument("--model", default=None, help="local model folder whose chat template to apply")
    inspect.add_argument("--max-rows", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    try:
        summary = inspect_file(args.file, args.task, args.model, args.max_rows)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
