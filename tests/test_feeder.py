"""PromptFeeder over several data-parallel ranks, run as threads with an in-process all-gather.

Skips balance across ranks (a rank whose stride holds only bad rows is refilled from the shared
stream instead of starving), all ranks agree on how far the stream advanced, a resumed feeder
reads exactly the rows an uninterrupted one reads, and a file with no usable row stops every
rank in the same round (none is left waiting in a collective). With prefetch (data.prefetch) the
first round's rows are encoded on a thread, and everything above holds unchanged.
"""

from __future__ import annotations

import io
import random
import threading
import traceback

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import data.loader as loader
from data.datasets import VLDataset
from data.loader import PromptFeeder, assign_rows
from data.processing import load_processor

N_ROWS = 40


def _png(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (shade, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _parquet(path, bad: set[int]):
    """N_ROWS rows; the rows in `bad` have no answer (skipped as missing_answer)."""
    image = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({
        "images": pa.array([[{"bytes": _png(i * 5), "path": None}] for i in range(N_ROWS)], type=image),
        "problem": [f"How many objects? {i} <image>" for i in range(N_ROWS)],
        "answer": [None if i in bad else str(i % 7) for i in range(N_ROWS)],
    })
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def processors(tiny_model):
    """One processor per rank, as on separate processes (a fast tokenizer is not shared across threads)."""
    return [load_processor(str(tiny_model)) for _ in range(3)]


@pytest.fixture(scope="module")
def every_other_bad(tmp_path_factory):
    return _parquet(tmp_path_factory.mktemp("feeder") / "odd_bad.parquet", {i for i in range(N_ROWS) if i % 2})


@pytest.fixture(scope="module")
def all_good(tmp_path_factory):
    return _parquet(tmp_path_factory.mktemp("feeder") / "all_good.parquet", set())


@pytest.fixture(scope="module")
def some_bad(tmp_path_factory):
    bad = set(random.Random(3).sample(range(N_ROWS), 14))
    return _parquet(tmp_path_factory.mktemp("feeder") / "some_bad.parquet", bad)


class Group:
    """An all-gather over threads: every rank's value, in rank order."""

    def __init__(self, world: int):
        self.slots = [0] * world
        self.barrier = threading.Barrier(world, timeout=60)
        self.calls = [0] * world
        self.results: list[list[list[int]]] = [[] for _ in range(world)]  # every gather's answer, per rank

    def gather(self, rank: int):
        def fn(value: int) -> list[int]:
            self.calls[rank] += 1
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            self.results[rank].append(out)
            return out
        return fn


def feeders(path, processors, world: int, shuffle: bool = False, seed: int = 0, group: Group | None = None):
    group = group or Group(world)
    return [PromptFeeder(VLDataset(path, "clevr"), processors[r], "clevr", seed=seed, shuffle=shuffle,
                         max_prompt_tokens=512, rank=r, world=world, gather=group.gather(r)) for r in range(world)]


def run(feeds: list[PromptFeeder], counts: list[list[int]], prefetch: bool = False):
    """Each rank calls next(counts[step][rank]) for every step, concurrently; (indices, errors) per rank."""
    prompts, errors = run_prompts(feeds, counts, prefetch)
    return [[[p.index for p in step] for step in rank] for rank in prompts], errors


def run_prompts(feeds: list[PromptFeeder], counts: list[list[int]], prefetch: bool = False):
    """As `run`, with the prompts themselves; with `prefetch` every next(count) is prefetched before it
    (the first too), as the trainer's step does between two steps."""
    world = len(feeds)
    prompts: list[list[list]] = [[] for _ in range(world)]
    errors: list[BaseException | None] = [None] * world

    def work(rank):
        try:
            for i, step in enumerate(counts):
                if prefetch and i == 0:
                    feeds[rank].prefetch(step[rank])
                prompts[rank].append(feeds[rank].next(step[rank]))
                if prefetch and i + 1 < len(counts):
                    feeds[rank].prefetch(counts[i + 1][rank])
        except BaseException as err:  # noqa: BLE001 - reported to the test below
            errors[rank] = err

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting: the ranks disagreed on the rounds"
    return prompts, errors


def test_rows_are_dealt_round_robin():
    assert assign_rows([3, 3], 0) == [[0, 2, 4], [1, 3, 5]]  # equal counts: the plain stride
    assert assign_rows([0, 3, 1], 10) == [[], [10, 12, 13], [11]]
    assert assign_rows([0, 0], 5) == [[], []]


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_rank_whose_stride_is_all_bad_is_refilled_from_the_shared_stream(every_other_bad, processors, prefetch):
    """Every other row is bad and there is no shuffle, so rank 1's stride holds only bad rows."""
    feeds = feeders(every_other_bad, processors, world=2)
    indices, errors = run(feeds, [[4, 4]] * 3, prefetch)
    assert errors == [None, None]
    for rank in range(2):
        assert [len(step) for step in indices[rank]] == [4, 4, 4]
        assert all(i % 2 == 0 for step in indices[rank] for i in step)  # only good rows
    flat = [i for rank in range(2) for step in indices[rank] for i in step]
    assert sorted(flat) == sorted(list(range(0, N_ROWS, 2)) + [0, 2, 4, 6])  # no row twice before the wrap
    states = [f.state_dict()["stream"] for f in feeds]
    assert states[0] == states[1]
    assert states[0]["epoch"] * N_ROWS + states[0]["position"] == 47  # the stream read 24 good rows and 23 bad
    assert feeds[0].stats.total + feeds[1].stats.total == 23


@pytest.mark.parametrize("prefetch", [False, True])
def test_ranks_may_ask_for_different_counts(some_bad, processors, prefetch):
    feeds = feeders(some_bad, processors, world=3, shuffle=True)
    indices, errors = run(feeds, [[2, 0, 5], [1, 1, 1], [0, 0, 0], [3, 2, 0]], prefetch)
    assert errors == [None] * 3
    assert [[len(s) for s in indices[r]] for r in range(3)] == [[2, 1, 0, 3], [0, 1, 0, 2], [5, 1, 0, 0]]
    for step in range(4):  # within one call no two ranks read the same row
        rows = [i for r in range(3) for i in indices[r][step]]
        assert len(rows) == len(set(rows))
    assert len({str(f.state_dict()["stream"]) for f in feeds}) == 1


@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_reads_the_rows_an_uninterrupted_run_reads(some_bad, processors, prefetch):
    counts = [[3, 3], [2, 4], [3, 3], [5, 1], [3, 3]]
    full, errors = run(feeders(some_bad, processors, world=2, shuffle=True, seed=7), counts)
    assert errors == [None, None]
    first = feeders(some_bad, processors, world=2, shuffle=True, seed=7)
    _, errors = run(first, counts[:2], prefetch)
    assert errors == [None, None]
    states = [f.state_dict() for f in first]
    resumed = feeders(some_bad, processors, world=2, shuffle=True, seed=7)
    for feed, state in zip(resumed, states):
        feed.load_state_dict(state)
    rest, errors = run(resumed, counts[2:], prefetch)
    assert errors == [None, None]
    assert [full[r][2:] for r in range(2)] == rest
    assert all(len(step) == n for r in range(2) for step, n in zip(full[r], [c[r] for c in counts]))


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_file_with_no_usable_row_stops_every_rank_in_the_same_round(tmp_path, processors, monkeypatch,
                                                                      prefetch):
    monkeypatch.setattr(loader, "MAX_SKIPS_PER_STEP", 10)
    path = _parquet(tmp_path / "all_bad.parquet", set(range(N_ROWS)))
    feeds = feeders(path, processors, world=2)
    _, errors = run(feeds, [[2, 2]], prefetch)
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    assert all("bad samples in one step across 2 data-parallel rank(s)" in str(e) for e in errors)
    assert "missing_answer" in str(errors[0])


# --- prefetch (data.prefetch) --------------------------------------------------------------------

@pytest.mark.parametrize("data, world, shuffle, counts", [
    ("every_other_bad", 2, False, [[4, 4]] * 3),  # rank 1's stride all bad: refill rounds every step
    ("some_bad", 3, True, [[2, 0, 5], [1, 1, 1], [0, 0, 0], [3, 2, 0]]),
    ("some_bad", 1, True, [[6], [6], [6], [6]]),
])
def test_prefetch_gives_exactly_what_next_gives(request, processors, data, world, shuffle, counts):
    """Same prompts (ids, pixels), same gathers with the same values in the same order, same stream and skips."""
    path = request.getfixturevalue(data)
    results = {}
    for prefetch in (False, True):
        group = Group(world)
        feeds = feeders(path, processors, world, shuffle=shuffle, seed=11, group=group)
        prompts, errors = run_prompts(feeds, counts, prefetch)
        assert errors == [None] * world
        results[prefetch] = prompts, group.results, [f.state_dict() for f in feeds]
    (plain, plain_gathers, plain_states), (ahead, ahead_gathers, ahead_states) = results[False], results[True]
    assert ahead_gathers == plain_gathers
    assert ahead_states == plain_states
    assert sum(sum(s["skips"].values()) for s in plain_states) > 0  # the file's bad rows were met
    for rank in range(world):
        assert [[p.index for p in step] for step in ahead[rank]] == [[p.index for p in step] for step in plain[rank]]
        for a, b in zip((p for step in ahead[rank] for p in step), (p for step in plain[rank] for p in step)):
            assert torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)


def test_prefetch_encodes_on_another_thread_and_returns_first(all_good, processors, monkeypatch):
    release = threading.Event()
    threads: list[int] = []
    encode = loader.encode_prompt

    def held(*args, **kwargs):
        assert release.wait(timeout=5), "the prefetch encoded on the calling thread"
        threads.append(threading.get_ident())
        return encode(*args, **kwargs)

    monkeypatch.setattr(loader, "encode_prompt", held)
    (feed,) = feeders(all_good, processors, world=1)
    feed.prefetch(4)
    assert threads == []  # prefetch returned while its rows wait to be encoded
    assert feed.state_dict()["stream"]["position"] == 0  # the stream moves when next takes them
    release.set()
    prompts = feed.next(4)
    assert [p.index for p in prompts] == [0, 1, 2, 3]
    assert len(threads) == 4 and threading.get_ident() not in threads
    assert feed.state_dict()["stream"]["position"] == 4


def test_an_error_in_the_prefetch_thread_is_raised_by_next(all_good, processors, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("the processor broke")

    monkeypatch.setattr(loader, "encode_prompt", broken)
    (feed,) = feeders(all_good, processors, world=1)
    feed.prefetch(2)  # the error is on the thread: prefetch itself returns
    with pytest.raises(ValueError, match="the processor broke") as info:
        feed.next(2)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "broken" in frames and "_encode_rows" in frames and "next" in frames  # the thread's frames, then next's
    assert any("prefetch" in note for note in info.value.__notes__)
    assert feed.state_dict()["stream"]["position"] == 0


def test_state_with_a_pending_prefetch_resumes_on_the_same_rows(some_bad, processors):
    (plain,) = feeders(some_bad, processors, world=1, shuffle=True, seed=5)
    (ahead,) = feeders(some_bad, processors, world=1, shuffle=True, seed=5)
    for n in (3, 4):
        plain.next(n)
        ahead.next(n)
    ahead.prefetch(8)
    state = ahead.state_dict()
    assert state == plain.state_dict()  # neither the stream nor the skips moved for the pending rows
    (resumed,) = feeders(some_bad, processors, world=1, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    rows = [p.index for p in plain.next(8)]
    assert [p.index for p in ahead.next(8)] == rows and [p.index for p in resumed.next(8)] == rows
    assert ahead.stats.as_dict() == plain.stats.as_dict() == resumed.stats.as_dict()
    assert ahead.stats.total > sum(state["skips"].values())  # the prefetched rows held bad ones

    # load_state_dict drops a pending prefetch: next reads from the loaded position, without the dropped rows
    (other,) = feeders(some_bad, processors, world=1, shuffle=True, seed=5)
    other.prefetch(2)
    other.load_state_dict(state)
    (again,) = feeders(some_bad, processors, world=1, shuffle=True, seed=5)
    again.load_state_dict(state)
    assert [p.index for p in other.next(2)] == [p.index for p in again.next(2)]
    assert other.state_dict() == again.state_dict()


def test_next_must_take_the_prefetch_made_for_it(all_good, processors):
    (feed,) = feeders(all_good, processors, world=1)
    feed.prefetch(2)
    with pytest.raises(RuntimeError, match=r"a prefetch for 2 prompts is still pending"):
        feed.prefetch(2)
    with pytest.raises(RuntimeError, match=r"next\(3\) .* after prefetch\(2\)"):
        feed.next(3)
    assert [p.index for p in feed.next(3)] == [0, 1, 2]  # the prefetch was dropped; the stream had not moved
    feed.prefetch(2)
    feed.stream.advance(1)
    with pytest.raises(RuntimeError, match=r"at stream position \(0, 4\) after prefetch\(2\) at \(0, 3\)"):
        feed.next(2)
