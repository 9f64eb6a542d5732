"""One namespaced metrics dict per step, written by rank 0: stdout line, metrics.jsonl and the
trackers of `logging.backends` (TensorBoard by default; wandb, MLflow: grpo/trackers.py).

Namespaces: loss/*, reward/*, rollout/*, fidelity/*, perf/*, memory/*, eval/*, data/*. Rank 0
also draws a progress bar with ETA on stderr when stderr is a terminal; the stdout line carries
the ETA too, so logs piped to a file show it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import yaml

from grpo.trackers import TrackerSet, build_trackers, check_backends

log = logging.getLogger("vlrl")

DEFAULT_BACKENDS = ("tensorboard", "jsonl")

# Keys shown on the compact stdout line, in order, when present.
STDOUT_KEYS = (
    "loss/total", "loss/grad_norm", "optim/lr", "reward/mean", "reward/accuracy", "reward/format",
    "rollout/response_len_mean", "fidelity/token_mult_prob_error", "loss/clip_fraction", "loss/kl",
    "eval/accuracy", "perf/step_s", "perf/tokens_per_s",
)


def _fmt(v: float) -> str:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if abs(v) >= 1000 or v == int(v):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:g}"
    return f"{v:.4g}"


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    """Writes each step's metrics on rank 0; other ranks hold a disabled logger."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, stdout: bool = True, progress: bool = True,
                 backends: Sequence[str] | None = None, config: dict | None = None):
        self.enabled = enabled
        self.total = total_steps
        self.start_step = start_step
        self.stdout = stdout
        self.progress = progress and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.trackers = TrackerSet([])
        self.path = Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        saved = _saved_config(Path(run_dir))
        config = saved if config is None else config
        if backends is None:
            backends = config.get("logging", {}).get("backends", DEFAULT_BACKENDS)
        backends = [b for b in check_backends(backends) if tensorboard or b != "tensorboard"]
        self.jsonl = "jsonl" in backends
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.jsonl:
            _truncate_after(self.path, start_step)
        self.trackers = TrackerSet(build_trackers(backends, run_dir, start_step=start_step, config=config))

    def eta(self, step: int) -> float:
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.monotonic() - self.t0) / done * (self.total - step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in sorted(metrics.items())}}
        if self.jsonl:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        self.trackers.log(step, {k: v for k, v in row.items() if k != "step"})
        if self.stdout:
            shown = " ".join(f"{k.split('/', 1)[1]}={_fmt(float(metrics[k]))}" for k in STDOUT_KEYS if k in metrics)
            print(f"step {step}/{self.total} {shown} eta={format_eta(self.eta(step))}", flush=True)
        if self.progress:
            done = step / max(self.total, 1)
            bar = "#" * int(30 * done)
            sys.stderr.write(f"\r[{bar:<30}] {step}/{self.total} ETA {format_eta(self.eta(step))}")
            sys.stderr.flush()
            if step >= self.total:
                sys.stderr.write("\n")

    def close(self) -> None:
        self.trackers.close()


def _saved_config(run_dir: Path) -> dict:
    """The run's resolved config.yaml (written by the trainer before the logger starts), or {}."""
    try:
        loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _row_step(raw: bytes) -> int | None:
    """The integer `step` of one metrics.jsonl line, or None when the line is not such a row."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _truncate_after(path: Path, step: int) -> None:
    """Drop rows past the resume point so a resumed run does not duplicate steps.

    A line that is not a JSON row with an integer step (torn by a crash mid-write, binary junk,
    `{"step": Infinity}`) is dropped
    with a warning naming the file and its line numbers, and appended to `metrics.jsonl.bad` so
    nothing is lost. The file is rewritten through a temporary name and an atomic rename.
    """
    if not path.is_file():
        return
    keep, bad = [], []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        row_step = _row_step(raw)
        if row_step is None:
            bad.append((number, raw))
            continue
        if row_step <= step:
            keep.append(raw)
    if bad:
        aside = path.with_name(path.name + ".bad")
        with aside.open("ab") as f:
            f.write(b"".join(raw + b"\n" for _, raw in bad))
        lines = ", ".join(str(n) for n, _ in bad[:10]) + (" ..." if len(bad) > 10 else "")
        log.warning("%s: %d unreadable line(s) (line %s: torn by a crash, not JSON or no integer step) dropped and "
                    "kept in %s",
                    path, len(bad), lines, aside)
    draft = path.with_name(path.name + ".tmp")
    draft.write_bytes(b"".join(raw + b"\n" for raw in keep))
    os.replace(draft, path)
