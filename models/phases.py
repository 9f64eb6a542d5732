"""Profiler ranges that name a training pass's phases (the vision tower, the language model, the logprobs, the
loss, the backward, the vision tower's backward once per pass under model.vision_once, the optimizer step, the
packing).

`phase_range(name)` opens a torch.profiler range `vlrl: <name>`; with no profiler running it costs next to
nothing. `rollout.telemetry.idle_gaps` charges the device's idle time to the innermost such range open when the
kernel that ended each gap was launched.

`PhaseClock` times the same ranges without a profiler, which slows the host and so shows a host-bound phase as
more host-bound than it is: each range's host seconds and, on CUDA, its device span (from the stream reaching
the range's start to reaching its end: its kernels and the idle between them), from a pair of CUDA events
queued with the work and read once at the end. A phase whose device span is its host time, with far fewer
FLOPs than that time allows, waits on the host.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASE_PREFIX = "vlrl: "

_CLOCK: list["PhaseClock | None"] = [None]  # the clock timing phase ranges now, if any


@contextmanager
def phase_range(name: str):
    """A profiler range named `vlrl: <name>` (torch.profiler.record_function), timed by a running PhaseClock."""
    with torch.profiler.record_function(PHASE_PREFIX + name):
        clock = _CLOCK[0]
        if clock is None:
            yield
            return
        mark = clock.start()
        try:
            yield
        finally:
            clock.stop(name, mark)


class PhaseClock:
    """Each phase range's count, host seconds and device span while the clock runs (see the module docstring).

        with PhaseClock(torch.device("cuda")) as clock:
            step()
        clock.totals()  # {"language model": {"count": 5, "host_s": ..., "device_s": ...}, ...}

    A range nested in another counts in both; a range of the same name nested in itself counts twice."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.spans: list[tuple[str, float, object, object]] = []  # (name, host seconds, start event, end event)

    def start(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def stop(self, name: str, mark) -> None:
        t0, begin = mark
        end = None
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.spans.append((name, time.perf_counter() - t0, begin, end))

    def __enter__(self) -> "PhaseClock":
        if _CLOCK[0] is not None:
            raise RuntimeError("a PhaseClock is already running; phase ranges feed one clock at a time")
        _CLOCK[0] = self
        return self

    def __exit__(self, *exc) -> None:
        _CLOCK[0] = None

    def totals(self) -> dict[str, dict]:
        """{phase: {"count", "host_s", "device_s" (None off CUDA)}}, in the order each phase first ended; reads the
        device once (after every recorded span has run)."""
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        out: dict[str, dict] = {}
        for name, host_s, begin, end in self.spans:
            row = out.setdefault(name, {"count": 0, "host_s": 0.0, "device_s": 0.0 if begin is not None else None})
            row["count"] += 1
            row["host_s"] += host_s
            if begin is not None:
                row["device_s"] += begin.elapsed_time(end) / 1e3
        return out


def clock_table(totals: dict[str, dict], wall_s: float) -> str:
    """PhaseClock.totals as lines: each phase's count, host seconds and device span."""
    lines = [f"phases of one step ({wall_s:.3f} s wall, no profiler; nested ranges count in each):",
             f"  {'phase':28s} {'count':>5s} {'host s':>8s} {'device s':>9s}"]
    for name, row in totals.items():
        device = "-" if row["device_s"] is None else f"{row['device_s']:9.3f}"
        lines.append(f"  {name:28s} {row['count']:5d} {row['host_s']:8.3f} {device:>9s}")
    return "\n".join(lines)
