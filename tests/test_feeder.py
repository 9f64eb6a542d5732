"""PromptFeeder over several data-parallel ranks, run as threads with an in-process all-gather.

Skips balance across ranks (a rank whose stride holds only bad rows is refilled from the shared
stream instead of starving), all ranks agree on how far the stream advanced, a resumed feeder
reads exactly the rows an uninterrupted one reads, and a file with no usable row stops every
rank in the same round (none is left waiting in a collective).
"""

from __future__ import annotations

import io
import random
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
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
def some_bad(tmp_path_factory):
    bad = set(random.Random(3).sample(range(N_ROWS), 14))
    return _parquet(tmp_path_factory.mktemp("feeder") / "some_bad.parquet", bad)


class Group:
    """An all-gather over threads: every rank's value, in rank order."""

    def __init__(self, world: int):
        self.slots = [0] * world
        self.barrier = threading.Barrier(world, timeout=60)
        self.calls = [0] * world

    def gather(self, rank: int):
        def fn(value: int) -> list[int]:
            self.calls[rank] += 1
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return fn


def feeders(path, processors, world: int, shuffle: bool = False, seed: int = 0):
    group = Group(world)
    return [PromptFeeder(VLDataset(path, "clevr"), processors[r], "clevr", seed=seed, shuffle=shuffle,
                         max_prompt_tokens=512, rank=r, world=world, gather=group.gather(r)) for r in range(world)]


def run(feeds: list[PromptFeeder], counts: list[list[int]]):
    """Each rank calls next(counts[step][rank]) for every step, concurrently; (indices, errors) per rank."""
    world = len(feeds)
    indices: list[list[list[int]]] = [[] for _ in range(world)]
    errors: list[BaseException | None] = [None] * world

    def work(rank):
        try:
            for step in counts:
                indices[rank].append([p.index for p in feeds[rank].next(step[rank])])
        except BaseException as err:  # noqa: BLE001 - reported to the test below
            errors[rank] = err

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting: the ranks disagreed on the rounds"
    return indices, errors


def test_rows_are_dealt_round_robin():
    assert assign_rows([3, 3], 0) == [[0, 2, 4], [1, 3, 5]]  # equal counts: the plain stride
    assert assign_rows([0, 3, 1], 10) == [[], [10, 12, 13], [11]]
    assert assign_rows([0, 0], 5) == [[], []]


def test_a_rank_whose_stride_is_all_bad_is_refilled_from_the_shared_stream(every_other_bad, processors):
    """Every other row is bad and there is no shuffle, so rank 1's stride holds only bad rows."""
    feeds = feeders(every_other_bad, processors, world=2)
    indices, errors = run(feeds, [[4, 4]] * 3)
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


def test_ranks_may_ask_for_different_counts(some_bad, processors):
    feeds = feeders(some_bad, processors, world=3, shuffle=True)
    indices, errors = run(feeds, [[2, 0, 5], [1, 1, 1], [0, 0, 0], [3, 2, 0]])
    assert errors == [None] * 3
    assert [[len(s) for s in indices[r]] for r in range(3)] == [[2, 1, 0, 3], [0, 1, 0, 2], [5, 1, 0, 0]]
    for step in range(4):  # within one call no two ranks read the same row
        rows = [i for r in range(3) for i in indices[r][step]]
        assert len(rows) == len(set(rows))
    assert len({str(f.state_dict()["stream"]) for f in feeds}) == 1


def test_resume_reads_the_rows_an_uninterrupted_run_reads(some_bad, processors):
    counts = [[3, 3], [2, 4], [3, 3], [5, 1], [3, 3]]
    full, errors = run(feeders(some_bad, processors, world=2, shuffle=True, seed=7), counts)
    assert errors == [None, None]
    first = feeders(some_bad, processors, world=2, shuffle=True, seed=7)
    _, errors = run(first, counts[:2])
    assert errors == [None, None]
    states = [f.state_dict() for f in first]
    resumed = feeders(some_bad, processors, world=2, shuffle=True, seed=7)
    for feed, state in zip(resumed, states):
        feed.load_state_dict(state)
    rest, errors = run(resumed, counts[2:])
    assert errors == [None, None]
    assert [full[r][2:] for r in range(2)] == rest
    assert all(len(step) == n for r in range(2) for step, n in zip(full[r], [c[r] for c in counts]))


def test_a_file_with_no_usable_row_stops_every_rank_in_the_same_round(tmp_path, processors, monkeypatch):
    monkeypatch.setattr(loader, "MAX_SKIPS_PER_STEP", 10)
    path = _parquet(tmp_path / "all_bad.parquet", set(range(N_ROWS)))
    feeds = feeders(path, processors, world=2)
    _, errors = run(feeds, [[2, 2]])
    assert all(isinstance(e, RuntimeError) for e in errors), errors
    assert all("bad samples in one step across 2 data-parallel rank(s)" in str(e) for e in errors)
    assert "missing_answer" in str(errors[0])
