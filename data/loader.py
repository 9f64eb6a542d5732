"""Per-step prompts for every data-parallel rank: dataset rows → canonical images → encoded prompts.

Bad rows (corrupt images, empty problems, over-long prompts, ...) are skipped, counted by
reason and logged with their row. Replacements come from the shared index stream, not from the
rank's own stride, so skips balance across ranks: a rank whose share of a step held bad rows
takes the next rows of the stream, whichever rank those would have gone to. Every rank learns
every rank's shortfall (one small all-gather per round), so all ranks agree on which rows each
one reads and on how far the stream advanced; the stream's position alone is the resume state.
"""

from __future__ import annotations

from typing import Callable

from data.datasets import SkipStats, VLDataset
from data.images import BadSample
from data.processing import EncodedPrompt, encode_prompt
from data.sampler import IndexStream

# A step fails when its bad rows exceed this many per data-parallel rank (an unusable file would
# otherwise be read round and round); the failure comes on every rank in the same round.
MAX_SKIPS_PER_STEP = 1000


def assign_rows(wanted: list[int], start: int) -> list[list[int]]:
    """Stream offsets for each rank: the next sum(wanted) rows, dealt out round-robin.

    Rank r gets wanted[r] offsets from [start, start + sum(wanted)); a rank that wants fewer drops
    out of the deal once it has them. With equal counts this is the stride rank, rank + world, ...
    """
    out: list[list[int]] = [[] for _ in wanted]
    offset = start
    for turn in range(max(wanted, default=0)):
        for rank, n in enumerate(wanted):
            if n > turn:
                out[rank].append(offset)
                offset += 1
    return out


class PromptFeeder:
    """Encoded prompts for one data-parallel rank, drawn with every other rank from one IndexStream.

    `gather(value)` returns every data-parallel rank's `value` in rank order (an all-gather; ranks
    of one tensor-parallel group read the same rows and pass the same value). All ranks call
    `next` together. Rows longer, or with more images, than `max_prompt_tokens` can hold are
    skipped from their sizes before any image is decoded or any text tokenized.
    """

    def __init__(self, dataset: VLDataset, processor, task: str, *, seed: int, shuffle: bool,
                 max_prompt_tokens: int, rank: int = 0, world: int = 1,
                 gather: Callable[[int], list[int]] | None = None, tool_prompt=None):
        if not 0 <= rank < world:
            raise ValueError(f"PromptFeeder: rank {rank} is outside a world of {world} data-parallel ranks")
        if gather is None and world > 1:
            raise ValueError(f"PromptFeeder: {world} data-parallel ranks need a gather function")
        self.dataset = dataset
        self.processor = processor
        self.task = task
        self.max_prompt_tokens = max_prompt_tokens
        self.tool_prompt = tool_prompt  # the tools' schemas in every prompt's system turn (rollout.tools)
        self.rank, self.world = rank, world
        self.gather = gather or (lambda value: [value])
        self.stream = IndexStream(len(dataset), seed, shuffle)
        self.stats = SkipStats()
        # each image takes at least one token; text is bounded by the tokenizer's longest token
        dataset.bound_rows(max_images=max_prompt_tokens, max_text_chars=processor.max_text_chars(max_prompt_tokens))

    def _gather(self, value: int) -> list[int]:
        values = [int(v) for v in self.gather(value)]
        if len(values) != self.world or values[self.rank] != value:
            raise RuntimeError(f"PromptFeeder: gather returned {values} on rank {self.rank} of {self.world} "
                               f"for the value {value}")
        return values

    def _encode(self, offsets: list[int]) -> list[EncodedPrompt]:
        out = []
        for offset in offsets:
            index = self.stream.peek(offset)
            try:
                sample = self.dataset.get(index)
                out.append(encode_prompt(self.processor, sample, self.task, self.max_prompt_tokens, self.tool_prompt))
            except BadSample as exc:
                self.stats.record(index, exc.reason, self.dataset.path, exc.detail)
        return out

    def next(self, count: int) -> list[EncodedPrompt]:
        """`count` encoded prompts for this rank (ranks may ask for different counts); collective."""
        if count < 0:
            raise ValueError(f"PromptFeeder.next: count must be >= 0, got {count}")
        out: list[EncodedPrompt] = []
        wanted = self._gather(count)
        used, bad = 0, 0
        while any(wanted):
            mine = assign_rows(wanted, used)[self.rank]
            used += sum(wanted)
            out += self._encode(mine)
            wanted = self._gather(count - len(out))  # what is still missing is what was bad
            bad += sum(wanted)
            if any(wanted) and bad > MAX_SKIPS_PER_STEP * self.world:
                raise RuntimeError(
                    f"{bad} bad samples in one step across {self.world} data-parallel rank(s) of "
                    f"{self.dataset.path} ({used - bad} usable of {used} read); skip reasons on this rank so far: "
                    f"{self.stats.as_dict()}. `python -m data.datasets inspect FILE --task T` scans the file"
                )
        self.stream.advance(used)
        return out

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "skips": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        for reason, n in state.get("skips", {}).items():
            self.stats.counts[reason] += n
