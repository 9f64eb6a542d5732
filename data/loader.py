"""Per-step prompts for every data-parallel rank: dataset rows → canonical images → encoded prompts.

Bad rows (corrupt images, empty problems, over-long prompts, ...) are skipped, counted by
reason and logged with their row. Replacements come from the shared index stream, not from the
rank's own stride, so skips balance across ranks: a rank whose share of a step held bad rows
takes the next rows of the stream, whichever rank those would have gone to. Every rank learns
every rank's shortfall (one small all-gather per round), so all ranks agree on which rows each
one reads and on how far the stream advanced; the stream's position alone is the resume state.

`prefetch(count)` runs the next `next(count)`'s first round early: its all-gather on the calling
thread, the encoding of its rows on a background thread, so reading, decoding and the processor
overlap whatever the caller does meanwhile (data.prefetch: the GRPO step's training). `next`
then continues from the second round; the gathers, the rows and the stream are the same as without.
"""

from __future__ import annotations

import threading
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


class _Prefetch:
    """The first round of one `next(count)`, its rows encoded on a daemon thread; `join()` waits for them."""

    def __init__(self, count: int, position: tuple[int, int], wanted: list[int], indices: list[int],
                 encode: Callable[[list[int]], tuple[list[EncodedPrompt], list[tuple[int, BadSample]]]]):
        self.count, self.position, self.wanted = count, position, wanted
        self.prompts: list[EncodedPrompt] = []
        self.skips: list[tuple[int, BadSample]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(encode, indices), name="prompt-prefetch", daemon=True)
        self.thread.start()

    def _run(self, encode, indices: list[int]) -> None:
        try:
            self.prompts, self.skips = encode(indices)
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread by PromptFeeder.next
            self.error = err

    def join(self) -> None:
        self.thread.join()


class PromptFeeder:
    """Encoded prompts for one data-parallel rank, drawn with every other rank from one IndexStream.

    `gather(value)` returns every data-parallel rank's `value` in rank order (an all-gather; ranks
    of one tensor-parallel group read the same rows and pass the same value). All ranks call
    `next` together. Rows longer, or with more images, than `max_prompt_tokens` can hold are
    skipped from their sizes before any image is decoded or any text tokenized.

    `prefetch(count)` (collective too) starts the next `next(count)` early; until that `next` takes
    it, no other call may come between them but `state_dict`, `load_state_dict` and `drop_prefetch`
    (which drop it) and `wait_prefetch`. The processor is not safe to share across threads: a caller that uses it
    elsewhere while a prefetch is pending calls `wait_prefetch()` first.
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
        self._pending: _Prefetch | None = None  # a prefetched first round that the next `next` takes
        # each image takes at least one token; text is bounded by the tokenizer's longest token
        dataset.bound_rows(max_images=max_prompt_tokens, max_text_chars=processor.max_text_chars(max_prompt_tokens))

    def _gather(self, value: int) -> list[int]:
        values = [int(v) for v in self.gather(value)]
        if len(values) != self.world or values[self.rank] != value:
            raise RuntimeError(f"PromptFeeder: gather returned {values} on rank {self.rank} of {self.world} "
                               f"for the value {value}")
        return values

    def _encode_rows(self, indices: list[int]) -> tuple[list[EncodedPrompt], list[tuple[int, BadSample]]]:
        """The good rows among `indices` encoded, and the bad ones with why (recorded by the caller:
        this also runs on the prefetch thread, and `self.stats` belongs to the calling thread)."""
        out, skips = [], []
        for index in indices:
            try:
                sample = self.dataset.get(index)
                out.append(encode_prompt(self.processor, sample, self.task, self.max_prompt_tokens, self.tool_prompt))
            except BadSample as exc:
                skips.append((index, exc))
        return out, skips

    def _record(self, skips: list[tuple[int, BadSample]]) -> None:
        for index, exc in skips:
            self.stats.record(index, exc.reason, self.dataset.path, exc.detail)

    def _encode(self, offsets: list[int]) -> list[EncodedPrompt]:
        out, skips = self._encode_rows([self.stream.peek(offset) for offset in offsets])
        self._record(skips)
        return out

    def next(self, count: int) -> list[EncodedPrompt]:
        """`count` encoded prompts for this rank (ranks may ask for different counts); collective.

        After `prefetch(count)` this takes the prefetched first round (waiting for its encoding) and
        makes the same later gathers as without it; after `prefetch` of another count it raises."""
        if count < 0:
            raise ValueError(f"PromptFeeder.next: count must be >= 0, got {count}")
        first = self._take_prefetch(count)
        if first is None:
            wanted = self._gather(count)
            first = wanted, self._encode(assign_rows(wanted, 0)[self.rank])
        return self._rounds(count, *first)

    def _rounds(self, count: int, wanted: list[int], out: list[EncodedPrompt]) -> list[EncodedPrompt]:
        """After the first round (`wanted` every rank's count, `out` this rank's prompts): the rounds that
        replace bad rows, until no rank misses any; then the stream advances past every row dealt."""
        used, bad = sum(wanted), 0
        while any(wanted):
            wanted = self._gather(count - len(out))  # what is still missing is what was bad
            bad += sum(wanted)
            if not any(wanted):
                break
            if bad > MAX_SKIPS_PER_STEP * self.world:
                raise RuntimeError(
                    f"{bad} bad samples in one step across {self.world} data-parallel rank(s) of "
                    f"{self.dataset.path} ({used - bad} usable of {used} read); skip reasons on this rank so far: "
                    f"{self.stats.as_dict()}. `python -m data.datasets inspect FILE --task T` scans the file"
                )
            mine = assign_rows(wanted, used)[self.rank]
            used += sum(wanted)
            out += self._encode(mine)
        self.stream.advance(used)
        return out

    def prefetch(self, count: int) -> None:
        """Start the next `next(count)` now; collective (every rank calls it where it would call `next`).

        The first round's gather runs here, on the calling thread; its rows are read, decoded and
        encoded on one daemon thread. The stream does not move until `next(count)` takes them."""
        if count < 0:
            raise ValueError(f"PromptFeeder.prefetch: count must be >= 0, got {count}")
        if self._pending is not None:
            raise RuntimeError(f"PromptFeeder.prefetch({count}): a prefetch for {self._pending.count} prompts is "
                               "still pending; call next() to take it first")
        wanted = self._gather(count)
        indices = [self.stream.peek(offset) for offset in assign_rows(wanted, 0)[self.rank]]
        self._pending = _Prefetch(count, self._position(), wanted, indices, self._encode_rows)

    def wait_prefetch(self) -> None:
        """Wait until a pending prefetch has encoded its rows (they stay for `next`); a no-op without one."""
        if self._pending is not None:
            self._pending.join()

    def drop_prefetch(self) -> None:
        """Wait for a pending prefetch and discard it (the stream never moved: its rows come again)."""
        self.wait_prefetch()  # its thread uses the processor: let it finish before anyone else does
        self._pending = None

    def _position(self) -> tuple[int, int]:
        return self.stream.epoch, self.stream.position

    def _take_prefetch(self, count: int) -> tuple[list[int], list[EncodedPrompt]] | None:
        """The pending prefetch's (gathered counts, prompts), its skips recorded; None without one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.join()
        # its gather already ran on every rank: running this call without it would leave the ranks one gather apart
        if pending.count != count or pending.position != self._position():
            raise RuntimeError(
                f"PromptFeeder.next({count}) at stream position {self._position()} after prefetch({pending.count}) "
                f"at {pending.position}: next must take exactly the prefetch made before it (same count, no stream "
                "change between them); the prefetch was dropped")
        if pending.error is not None:
            pending.error.add_note("raised while encoding prefetched rows (PromptFeeder.prefetch's thread)")
            raise pending.error
        self._record(pending.skips)
        return pending.wanted, pending.prompts

    def state_dict(self) -> dict:
        """The stream's position and the skip counts; a pending prefetch is in neither (it has not moved the
        stream, and its skips are recorded when `next` takes it), so a resumed run reads its rows again."""
        return {"stream": self.stream.state_dict(), "skips": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream and the skip counts; a pending prefetch is waited for and dropped."""
        self.drop_prefetch()
        self.stream.load_state_dict(state["stream"])
        for reason, n in state.get("skips", {}).items():
            self.stats.counts[reason] += n
