"""optim.reserve_cache on a GPU: a pass that allocates after the cache was emptied makes a driver allocation per
new tensor; after `reserve_cache` it splits the reserved chunks and makes none, and the next emptying gives every
chunk back. Prints the pass's time both ways (the cost the reserve saves)."""

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the caching allocator needs CUDA", allow_module_level=True)

from rollout.colocation import CACHE_CHUNK_BYTES, reserve_cache  # noqa: E402

MIB = 2**20


def _allocs() -> int:
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def _pass(device: torch.device, sizes: list[int]) -> float:
    """Allocate tensors of these sizes (an update's activations, kept until the end), touch each, free them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    kept = []
    for size in sizes:
        kept.append(torch.empty(size, dtype=torch.uint8, device=device))
        kept[-1][:1].zero_()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del kept
    return seconds


def test_reserved_chunks_serve_a_pass_and_go_back_whole():
    device = torch.device("cuda", torch.cuda.current_device())
    # 600 tensors of 12-52 MiB (~19 GiB), sizes varied as activations' are
    sizes = [(12 + 8 * (i % 6)) * MIB + 4096 * (i % 7) for i in range(600)]
    total = sum(sizes)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    start = _allocs()
    cold = _pass(device, sizes)
    cold_allocs = _allocs() - start
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == before

    made = reserve_cache(device, total + len(sizes) * 2 * MIB)  # room for the allocator's 2 MiB rounding
    assert made > total and torch.cuda.memory_reserved() - before >= made
    start = _allocs()
    warm = _pass(device, sizes)
    warm_allocs = _allocs() - start
    print(f"\nreserve_cache: a pass of {len(sizes)} tensors ({total / 2**30:.1f} GiB) after emptying the cache: "
          f"{cold * 1e3:.1f} ms, {cold_allocs} driver allocations; after reserving {made / 2**30:.1f} GiB in "
          f"{CACHE_CHUNK_BYTES >> 30} GiB chunks: {warm * 1e3:.1f} ms, {warm_allocs} driver allocations")
    assert cold_allocs >= len(sizes) // 2 and warm_allocs <= len(sizes) // 20
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == before  # no chunk kept: nothing outlived the pass
