"""A deterministic, resumable stream of dataset indices shared by all ranks.

Every rank computes the same shuffled order (seeded by seed and epoch). A step takes its prompts
from the stream at offsets rank, rank + world, rank + 2·world, ...; a rank that hits a bad sample
keeps walking its stride, and the stream advances past the furthest offset any rank used. The
state is just (epoch, position), so resume continues exactly where the run stopped.
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
        self._order: list[int] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def peek(self, offset: int) -> int:
        """The index `offset` places after the current position (crossing epochs as needed)."""
        pos = self.position + offset
        epoch = self.epoch + pos // self.size
        if epoch == self.epoch:
            if self._order is None:
                self._order = self._epoch_order(self.epoch)
            return self._order[pos]
        return self._epoch_order(epoch)[pos % self.size]

    def advance(self, count: int) -> None:
        pos = self.position + count
        if pos >= self.size:
            self.epoch += pos // self.size
            self._order = None
        self.position = pos % self.size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("size", self.size) != self.size:
            raise ValueError(f"resume: the dataset had {state['size']} rows, now it has {self.size}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None
