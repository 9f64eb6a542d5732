"""Write a procedural dataset (CLEVR-like counting, Geometry3K-like, or the zoom-in task) to disk.

    python tools/make_dataset.py --kind clevr --n 1000 --seed 0 --out data/clevr_train.parquet
    python tools/make_dataset.py --kind geo3k --n 200 --seed 1 --out geo.parquet --size 224x224
    python tools/make_dataset.py --kind clevr --n 50 --seed 0 --out demo.jsonl --format jsonl \\
        --min-objects 1 --max-objects 6
    python tools/make_dataset.py --kind zoom --n 512 --seed 0 --out zoom.parquet --max-pixels 12544
    python tools/make_dataset.py --kind zoom_sft --n 512 --seed 1 --out zoom_sft.parquet --max-pixels 12544
    python tools/make_dataset.py --kind video --n 64 --seed 0 --out video.parquet --fps 2 --frames 8 --size 112x112

Parquet files have the public schema (images: list<struct<bytes: binary, path: string>>,
problem, answer). JSONL writes one PNG per image into `<out stem>_images/` beside the
file and stores paths relative to the JSONL's folder. `zoom` writes DeepEyes-47k's parquet schema
and `zoom_sft` tool-using trajectories in `messages` form (data/generators/zoom.py); both are
parquet only, with boxes in the coordinates of the canvas seen under --min-pixels/--max-pixels.
`video` writes short mp4 clips (data/generators/video.py): parquet holds them in a `videos` column
(list<struct<bytes, path>>); JSONL writes them into `<out stem>_videos/` beside the file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script from anywhere: make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
import pyarrow.parquet as pq

from data.generators import GENERATORS, SCHEMAS, VIDEO_SCHEMAS

IMAGE_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
SCHEMA = pa.schema([("images", IMAGE_TYPE), ("problem", pa.string()), ("answer", pa.string())])


def write_parquet(rows: list[dict], out: Path, schema: pa.Schema = SCHEMA) -> None:
    """Rows in the public schema (or `schema`) -> one parquet file."""
    columns = {name: [row[name] for row in rows] for name in schema.names}
    pq.write_table(pa.Table.from_pydict(columns, schema=schema), out)


def write_jsonl(rows: list[dict], out: Path) -> None:
    """Rows -> JSONL with image files in `<stem>_images/`, paths relative to the JSONL."""
    image_dir = out.parent / f"{out.stem}_images"
    image_dir.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            media = {}
            for key in ("images", "videos"):
                if key not in row:
                    continue
                folder = image_dir if key == "images" else out.parent / f"{out.stem}_videos"
                folder.mkdir(parents=True, exist_ok=True)
                media[key] = []
                for item in row[key]:
                    (folder / item["path"]).write_bytes(item["bytes"])
                    media[key].append(f"{folder.name}/{item['path']}")
            f.write(json.dumps({**media, "problem": row["problem"], "answer": row["answer"]}) + "\n")


def make_dataset(kind: str, n: int, seed: int, out: str | Path, *, fmt: str | None = None, **options) -> Path:
    """Generate `n` rows of `kind` with `seed` and write them to `out`; returns the path.

    `fmt` is "parquet" or "jsonl" (default: from the suffix of `out`, else parquet);
    other keyword options go to the generator (size, min_objects, max_objects, ...).
    """
    if kind not in GENERATORS:
        raise ValueError(f"unknown dataset kind {kind!r}; known kinds: {', '.join(GENERATORS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = Path(out)
    fmt = fmt or ("jsonl" if out.suffix.lower() in (".jsonl", ".json") else "parquet")
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"format must be 'parquet' or 'jsonl', got {fmt!r}")
    if kind in SCHEMAS and fmt != "parquet":
        raise ValueError(f"--kind {kind} writes parquet only (its rows hold chat messages), got {fmt!r}")
    rows = GENERATORS[kind](n, seed, **options)
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind in SCHEMAS:
        write_parquet(rows, out, SCHEMAS[kind])
    elif fmt == "parquet" and kind in VIDEO_SCHEMAS:
        write_parquet(rows, out, VIDEO_SCHEMAS[kind])
    else:
        (write_parquet if fmt == "parquet" else write_jsonl)(rows, out)
    return out


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size must look like 112x112, got {text!r}") from None
    return width, height


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", required=True, choices=sorted(GENERATORS))
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", choices=("parquet", "jsonl"), default=None,
                        help="default: from the --out suffix")
    parser.add_argument("--size", type=_parse_size, default=None, help="WxH, e.g. 112x112")
    parser.add_argument("--min-objects", type=int, default=None, help="clevr only")
    parser.add_argument("--max-objects", type=int, default=None, help="clevr only")
    parser.add_argument("--min-pixels", type=int, default=None, help="zoom only: data.min_pixels of the run")
    parser.add_argument("--max-pixels", type=int, default=None, help="zoom only: data.max_pixels of the run")
    parser.add_argument("--places", type=int, default=None, help="zoom only: 1, 2 or 4 squares that can be framed")
    parser.add_argument("--fps", type=float, default=None, help="video only: frames per second of each clip")
    parser.add_argument("--frames", type=int, default=None, help="video only: frames in each clip")
    args = parser.parse_args(argv)
    options = {}
    if args.size is not None:
        options["size"] = args.size
    for key in ("fps", "frames"):
        if getattr(args, key) is not None:
            if args.kind not in VIDEO_SCHEMAS:
                parser.error(f"--{key} applies to --kind video only")
            options[key] = getattr(args, key)
    for key in ("min_pixels", "max_pixels", "places"):
        if getattr(args, key) is not None:
            if args.kind not in SCHEMAS:
                parser.error(f"--{key.replace('_', '-')} applies to --kind zoom and zoom_sft only")
            options[key] = getattr(args, key)
    if args.min_objects is not None or args.max_objects is not None:
        if args.kind != "clevr":
            parser.error("--min-objects/--max-objects apply to --kind clevr only")
        options.update({k: v for k, v in (("min_objects", args.min_objects),
                                          ("max_objects", args.max_objects)) if v is not None})
    start = time.perf_counter()
    out = make_dataset(args.kind, args.n, args.seed, args.out, fmt=args.format, **options)
    seconds = time.perf_counter() - start
    print(f"wrote {args.n} {args.kind} rows (seed {args.seed}) to {out} "
          f"[{out.stat().st_size / 1e6:.2f} MB, {seconds:.1f}s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
