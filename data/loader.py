"""Per-step prompts for one rank: dataset rows → canonical images → encoded prompts.

Bad rows (corrupt images, empty problems, over-long prompts, ...) are skipped, counted by
reason and logged with their row; the rank walks further down its stride of the shared index
stream to replace them, so a step always gets the prompts it asked for.
"""

from __future__ import annotations

from typing import Callable

from data.datasets import SkipStats, VLDataset
from data.images import BadSample
from data.processing import EncodedPrompt, encode_prompt
from data.sampler import IndexStream

MAX_SKIPS_PER_STEP = 1000


class PromptFeeder:
    def __init__(self, dataset: VLDataset, processor, task: str, *, seed: int, shuffle: bool,
                 max_prompt_tokens: int, rank: int, world: int, reduce_max: Callable[[int], int]):
        self.dataset = dataset
        self.processor = processor
        self.task = task
        self.max_prompt_tokens = max_prompt_tokens
        self.rank, self.world = rank, world
        self.reduce_max = reduce_max
        self.stream = IndexStream(len(dataset), seed, shuffle)
        self.stats = SkipStats()

    def next(self, count: int) -> list[EncodedPrompt]:
        """`count` encoded prompts for this rank; all ranks must call together (one all-reduce)."""
        out: list[EncodedPrompt] = []
        k = 0
        while len(out) < count:
            if k - len(out) > MAX_SKIPS_PER_STEP:
                raise RuntimeError(
                    f"{k - len(out)} bad samples in a row in {self.dataset.path}; skip reasons so far: "
                    f"{self.stats.as_dict()}"
                )
            index = self.stream.peek(self.rank + k * self.world)
            k += 1
            try:
                sample = self.dataset.get(index)
                out.append(encode_prompt(self.processor, sample, self.task, self.max_prompt_tokens))
            except BadSample as exc:
                self.stats.record(index, exc.reason, self.dataset.path, str(exc))
        used = self.reduce_max(k)
        self.stream.advance(used * self.world)
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "skips": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        for reason, n in state.get("skips", {}).items():
            self.stats.counts[reason] += n
