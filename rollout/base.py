"""The engine interface every rollout engine implements.

Prompts arrive as token ids whose image placeholders are already expanded (one `<|image_pad|>`
per merged patch, exactly as the policy sees them) plus the canonical images and the processor
outputs for them. Each engine returns, per response, the sampled token ids and the logprob of
each sampled token under the distribution the trainer evaluates (after temperature, before
top-p/top-k truncation), and a finish reason.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch

from rollout.telemetry import label_new_threads, phase


@contextmanager
def timed(times: dict, key: str):
    """Add the block's wall-clock seconds to `times[key]` (host time only: no device sync); while the block
    runs, GPU telemetry's readings count for `key` where it is one of its phases (rollout/telemetry.py)."""
    start = time.monotonic()
    try:
        with phase(key):
            yield
    finally:
        times[key] = times.get(key, 0.0) + time.monotonic() - start
        label_new_threads(key)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: list[int] = field(default_factory=list)  # never sampled (image placeholders)
    seed: int | None = None


@dataclass
class PromptInput:
    """One prompt: expanded token ids, the canonical images and videos, and the processor outputs for them."""

    input_ids: list[int]
    images: list = field(default_factory=list)  # canonical RGB PIL images (already resized)
    pixel_values: torch.Tensor | None = None  # (patches, dim) for all images of this prompt
    image_grid_thw: torch.Tensor | None = None  # (num_images, 3)
    videos: list = field(default_factory=list)  # canonical clips (data.video.Video), in order
    pixel_values_videos: torch.Tensor | None = None  # (patches, dim) for all videos of this prompt
    video_grid_thw: torch.Tensor | None = None  # (num_videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (num_videos,)


@dataclass
class Generation:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    # MoE routing replay: the experts each MoE layer chose for every token of the prompt and the
    # response, (prompt + response tokens, layers, k) int ids, -1 for a token the engine did not run
    # (the last sampled one); None unless the engine was asked to report them.
    routed_experts: torch.Tensor | None = None


class Engine(ABC):
    """Generates responses; sleeps to give the GPU back to training; takes new weights by refit.

    What colocation (rollout/colocation.py) relies on: `generate` only while awake; `sleep`
    frees the engine's device memory and `wake` undoes it, both idempotent; `refit` works awake
    or asleep and leaves any cache that could hold results of the old weights empty; `dtype` is
    what refit tensors are rounded to (None: the engine casts them itself).
    """

    dtype: torch.dtype | None = None
    # True when `sleep` drops the weights rather than keeping them (vLLM's sleep level 2): colocation
    # then refits before the next generation even if the policy has not moved.
    sleep_discards_weights: bool = False

    @abstractmethod
    def generate(self, prompts: list[PromptInput], params: SamplingParams) -> list[Generation]:
        """n responses per prompt, ordered prompt-major: [p0 r0, p0 r1, ..., p1 r0, ...]."""

    @abstractmethod
    def refit(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors named with the transformers checkpoint names into the engine."""

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights offloaded, KV cache dropped)."""

    def wake(self) -> None:
        """Undo `sleep`."""
