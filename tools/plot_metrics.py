"""Draw a run's curves (reward, accuracy, ...) from metrics.jsonl into a PNG, with PIL only.

    python tools/plot_metrics.py runs/demo_grpo --keys reward/mean reward/accuracy eval/accuracy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
DEFAULT_KEYS = ("reward/mean", "reward/accuracy", "eval/accuracy")


def read_series(metrics_path: Path, keys) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for k in keys:
            if k in row:
                series[k].append((int(row["step"]), float(row[k])))
    return series


def plot(series: dict[str, list[tuple[int, float]]], out: Path, title: str = "", size=(900, 500),
         xlabel: str = "step", unit_range: bool = True) -> Path:
    """Line chart of each series on a shared x axis; the value axis spans [min(0, lo), max(1, hi)]
    with `unit_range`, else the data's own range."""
    w, h = size
    left, right, top, bottom = 60, 20, 40, 60
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    points = [p for s in series.values() for p in s]
    if not points:
        d.text((w // 2 - 40, h // 2), "no data", fill="black")
        img.save(out)
        return out
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    lo, hi = min(p[1] for p in points), max(p[1] for p in points)
    y0, y1 = (min(0.0, lo), max(1.0, hi)) if unit_range else (lo, hi if hi > lo else lo + 1e-12)
    x1 = x1 if x1 > x0 else x0 + 1
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    sy = lambda y: h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom)  # noqa: E731
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        d.line([left, sy(yv), w - right, sy(yv)], fill=(225, 225, 225))
        d.text((8, sy(yv) - 6), f"{yv:.2f}" if unit_range else f"{yv:.1e}", fill="black")
    for i in range(6):
        xv = x0 + (x1 - x0) * i / 5
        d.text((sx(xv) - 8, h - bottom + 6), f"{xv:.0f}", fill="black")
    d.text((w // 2 - 15, h - 30), xlabel, fill="black")
    d.text((left, 12), title, fill="black")
    for k, (name, pts) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        xy = [(sx(x), sy(y)) for x, y in pts]
        if len(xy) > 1:
            d.line(xy, fill=color, width=2)
        for x, y in xy:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        d.text((w - right - 180, top + 8 + 14 * k), f"- {name}", fill=color)
    img.save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    p.add_argument("--out", default=None, help="default: <run_dir>/tensorboard/curves.png")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    out = Path(args.out) if args.out else run / "tensorboard" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(read_series(run / "metrics.jsonl", args.keys), out, title=str(run))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
