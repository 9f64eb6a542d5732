"""memory/peak_gb on a GPU: the step's fullest point as torch.cuda.mem_get_info shows it, within 2%,
also when a pass allocates from blocks torch's allocator already holds."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("device memory needs CUDA", allow_module_level=True)

from rollout.colocation import DevicePeak  # noqa: E402

GIB = 2**30


def _used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_peak_is_the_fullest_point_with_cached_blocks_reused():
    device = torch.device("cuda", torch.cuda.current_device())
    cached = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    del cached  # 4 GiB stays reserved by the allocator, in the device's used memory
    peak = DevicePeak(device)
    peak.begin()
    with peak.training():
        a = torch.empty(4 * GIB, dtype=torch.uint8, device=device)  # from the cached blocks
        b = torch.empty(2 * GIB, dtype=torch.uint8, device=device)  # new memory
        fullest = _used()
        del a, b
    got = peak.end() * GIB
    assert abs(got - fullest) <= 0.02 * fullest, (got / GIB, fullest / GIB)
    assert got <= torch.cuda.mem_get_info()[1]
