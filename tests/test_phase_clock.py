"""models.phases.PhaseClock: the phase ranges' counts and host seconds without a profiler (device spans on CUDA)."""

import time

import pytest
import torch

from models.phases import PhaseClock, _CLOCK, clock_table, phase_range


def test_ranges_are_counted_and_timed_only_while_a_clock_runs():
    with phase_range("before"):
        pass
    with PhaseClock("cpu") as clock:
        for _ in range(3):
            with phase_range("outer"):
                time.sleep(0.01)
                with phase_range("inner"):
                    time.sleep(0.02)
        with pytest.raises(ValueError):
            with phase_range("raised"):
                raise ValueError("inside a range")
    with phase_range("after"):
        pass
    totals = clock.totals()
    assert list(totals) == ["inner", "outer", "raised"]  # in the order each first ended; none outside the clock
    assert totals["outer"]["count"] == totals["inner"]["count"] == 3 and totals["raised"]["count"] == 1
    assert 0.06 <= totals["inner"]["host_s"] < totals["outer"]["host_s"]  # a nested range counts in both
    assert totals["outer"]["host_s"] >= 0.09 and totals["outer"]["device_s"] is None  # no device off CUDA
    assert _CLOCK[0] is None
    table = clock_table(totals, 0.2)
    assert "outer" in table and "0.2" in table and "-" in table.splitlines()[-1]


def test_one_clock_at_a_time():
    with PhaseClock("cpu"):
        with pytest.raises(RuntimeError, match="already running"):
            with PhaseClock("cpu"):
                pass
    assert _CLOCK[0] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device spans need CUDA")
def test_device_spans_cover_the_ranges_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    with PhaseClock("cuda") as clock:
        with phase_range("products"):
            for _ in range(20):
                x = x @ x.t() / 4096
    totals = clock.totals()
    assert totals["products"]["device_s"] > 0
