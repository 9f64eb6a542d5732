"""A deterministic, resumable stream of dataset indices shared by all ranks.

Every rank computes the same shuffled order (seeded by seed and epoch). A step deals the rows
after the position out to the ranks (data/loader.py: offsets rank, rank + world, ... when every
rank wants the same count; a rank's bad rows are replaced by the rows that follow), and the stream
advances past every row dealt, on every rank alike. The state is just (epoch, position), so resume
continues exactly where the run stopped.
"""

from __future__ import annotations

import random


class IndexStream:
    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size <= 0:
            raise ValueError("the dataset has no rows")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._orders: dict[int, list[int]] = {}  # the epochs peeked lately (a step may cross into the next)

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return self._orders[epoch]

    def peek(self, offset: int) -> int:
        """The index `offset` places after the current position (crossing epochs as needed)."""
        if offset < 0:
            raise ValueError(f"IndexStream.peek: offset must be >= 0, got {offset}")
        pos = self.position + offset
        return self._epoch_order(self.epoch + pos // self.size)[pos % self.size]

    def advance(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"IndexStream.advance: count must be >= 0, got {count}")
        pos = self.position + count
        self.epoch += pos // self.size
        self.position = pos % self.size
        for epoch in [e for e in self._orders if e < self.epoch]:
            del self._orders[epoch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("size", self.size) != self.size:
            raise ValueError(f"resume: the dataset had {state['size']} rows, now it has {self.size}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.size:
            raise ValueError(f"resume: the data stream's state (epoch {epoch}, position {position}) does not fit a "
                             f"dataset of {self.size} rows")
        self.epoch, self.position = epoch, position
        self._orders.clear()
