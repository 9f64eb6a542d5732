"""The batch container: per-sample tensors that slice, shard and concatenate together.

A `PackedGenericDataItem` is a batch field that is not one padded tensor: a list of per-sample
tensors (or `None` for a sample without that field, e.g. a text-only sample's pixels) plus the
dimension along which they concatenate. `pixel_values` rows are patches (dim 0), `image_grid_thw`
has one row per image (dim 0), token fields are 1-D per sample.

A `Batch` is a dict of such items that share one sample axis, so `batch.slice(idx)` always keeps
a micro-batch's images with its sequences. Slicing never copies tensors: the G responses of one
prompt can share one physical image tensor.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


class PackedGenericDataItem:
    """Per-sample tensors (or None) plus the dim they concatenate on."""

    def __init__(self, items: Sequence[torch.Tensor | None], dim: int = 0):
        self.items = list(items)
        self.dim = dim

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        return self.items[i]

    def __repr__(self) -> str:
        shapes = [None if t is None else tuple(t.shape) for t in self.items[:4]]
        more = "..." if len(self.items) > 4 else ""
        return f"PackedGenericDataItem(n={len(self)}, dim={self.dim}, shapes={shapes}{more})"

    def slice(self, indices: Iterable[int]) -> "PackedGenericDataItem":
        """Select samples by index (repeats allowed; tensors are shared, not copied)."""
        return PackedGenericDataItem([self.items[i] for i in indices], self.dim)

    @staticmethod
    def concat(parts: Sequence["PackedGenericDataItem"]) -> "PackedGenericDataItem":
        """Join batches sample-wise; all parts must concatenate along the same dim."""
        dims = {p.dim for p in parts}
        if len(dims) > 1:
            raise ValueError(f"cannot concat PackedGenericDataItems with different dims {sorted(dims)}")
        items = [t for p in parts for t in p.items]
        return PackedGenericDataItem(items, parts[0].dim if parts else 0)

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The concatenation the model's forward takes; None when every sample is None."""
        present = [t for t in self.items if t is not None]
        if not present:
            return None
        out = torch.cat(present, dim=self.dim) if len(present) > 1 else present[0]
        return out.to(device) if device is not None else out

    def to(self, device: torch.device | str) -> "PackedGenericDataItem":
        return PackedGenericDataItem([None if t is None else t.to(device) for t in self.items], self.dim)


class Batch:
    """Named PackedGenericDataItems over one sample axis; slicing keeps every field aligned."""

    def __init__(self, fields: dict[str, PackedGenericDataItem] | None = None):
        self.fields: dict[str, PackedGenericDataItem] = {}
        for name, item in (fields or {}).items():
            self[name] = item

    def __len__(self) -> int:
        return len(next(iter(self.fields.values()))) if self.fields else 0

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def __getitem__(self, name: str) -> PackedGenericDataItem:
        return self.fields[name]

    def __setitem__(self, name: str, item: PackedGenericDataItem | Sequence[torch.Tensor | None]) -> None:
        if not isinstance(item, PackedGenericDataItem):
            item = PackedGenericDataItem(item)
        if self.fields and len(item) != len(self):
            raise ValueError(f"batch field '{name}' has {len(item)} samples, the batch has {len(self)}")
        self.fields[name] = item

    def keys(self):
        return self.fields.keys()

    def slice(self, indices: Iterable[int]) -> "Batch":
        idx = list(indices)
        return Batch({k: v.slice(idx) for k, v in self.fields.items()})

    @staticmethod
    def concat(parts: Sequence["Batch"]) -> "Batch":
        names = [set(p.keys()) for p in parts]
        if any(n != names[0] for n in names):
            raise ValueError(f"cannot concat batches with different fields: {[sorted(n) for n in names]}")
        return Batch({k: PackedGenericDataItem.concat([p[k] for p in parts]) for k in parts[0].keys()})

    def shard(self, rank: int, world: int) -> "Batch":
        """The contiguous block of samples this data-parallel rank owns; the sample count must divide."""
        n = len(self)
        if n % world:
            raise ValueError(f"batch of {n} samples does not divide across {world} data-parallel ranks")
        per = n // world
        return self.slice(range(rank * per, (rank + 1) * per))
