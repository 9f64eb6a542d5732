"""Graceful stop on SIGTERM/SIGINT: finish the current step, write a checkpoint, exit 0.

A cluster scheduler preempts a job by sending SIGTERM (Ctrl-C sends SIGINT) and, after a grace
period, SIGKILL. `PreemptionGuard` turns the first signal into a request: the handler only sets
a flag and says so on stderr; the loop asks `stop_requested(device)` once per step, and since
that call all-reduces the flag (MAX) every rank stops after the same step, even when only one
rank was signalled. A second signal means "now": the process exits at once with 128 + signum,
without a checkpoint (the previous complete one is untouched; see grpo/checkpoint.py).

Launchers forward signals: under torchrun, Ctrl-C reaches each worker from the terminal and
again from the agent a few milliseconds later, and a scheduler may signal every process of the
job. A repeat within `repeat_window_s` of the first signal is therefore the same request, not a
second one. The agent also kills its workers 30 s after forwarding a signal (torchrun's
`--shutdown-timeout` on recent torch), so one step plus one checkpoint write must fit in that
grace period, as must the scheduler's own (e.g. SLURM's KillWait).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Owns the SIGTERM/SIGINT handlers of a training run; `close()` puts the previous ones back.

    `current_step` (optional) names the step in the message printed when a signal arrives.
    Handlers can only be installed from the main thread; elsewhere the guard installs nothing
    (`installed` is False) and the signals keep their previous behaviour.
    """

    def __init__(self, current_step: Callable[[], int] | None = None, *, repeat_window_s: float = 2.0,
                 signals: tuple[int, ...] = HANDLED_SIGNALS):
        self.current_step = current_step
        self.repeat_window_s = repeat_window_s
        self.signum: int | None = None  # the first signal received, if any
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self.installed = threading.current_thread() is threading.main_thread()
        if self.installed:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_at = signum, now
            step = f"finishing step {self.current_step()}" if self.current_step else "finishing the current step"
            _say(f"received {name}: {step}, then writing a checkpoint (send it again to exit at once)")
        elif now - self._first_at > self.repeat_window_s:
            _say(f"received {name} again: exiting now without writing a checkpoint")
            os._exit(128 + signum)
        # else: the launcher forwarding the same request; already noted

    def should_stop(self) -> bool:
        """Whether this process has received a stop signal (local; no communication)."""
        return self.signum is not None

    def stop_requested(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank has received a stop signal.

        Collective: every rank must call it at the same point, once per step (the loop calls it
        after each step), so that all ranks agree to stop after the same step.
        """
        flag = torch.tensor([1 if self.should_stop() else 0], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Restore the handlers that were in place before this guard."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _say(message: str) -> None:
    # os.write, not print: a handler may run while the main thread is inside a print to the same
    # stream, and re-entering a buffered stream raises.
    os.write(2, f"[rank {os.environ.get('RANK', '0')}] {message}\n".encode())
