"""Profiler ranges that name a training pass's phases (the vision tower, the language model, the logprobs, the
loss, the backward, the vision tower's backward once per pass under model.vision_once, the optimizer step, the
packing).

`phase_range(name)` opens a torch.profiler range `vlrl: <name>`; with no profiler running it costs next to
nothing. `rollout.telemetry.idle_gaps` charges the device's idle time to the innermost such range open when the
kernel that ended each gap was launched.
"""

from __future__ import annotations

import torch

PHASE_PREFIX = "vlrl: "


def phase_range(name: str):
    """A profiler range named `vlrl: <name>` (torch.profiler.record_function)."""
    return torch.profiler.record_function(PHASE_PREFIX + name)
