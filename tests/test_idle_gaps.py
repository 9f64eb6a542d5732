"""rollout.telemetry.idle_gaps: the device's idle time between kernels, charged to the phase range and the host op
that launched the kernel ending each gap (synthetic profiler events: a CPU machine's profile has no kernels)."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from rollout.telemetry import gap_report, idle_gaps


def _event(name, start, end, device=DeviceType.CPU, id=0, linked=0, parent=None, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, id=id,
                           linked_correlation_id=linked, cpu_parent=parent, is_user_annotation=annotation)


def _events():
    pack = _event("vlrl: pack", 0, 100, annotation=True)
    copy = _event("aten::copy_", 10, 20, id=1, parent=pack)
    backward = _event("vlrl: backward", 200, 400, annotation=True)
    top = _event("autograd::engine::evaluate_function: MmBackward0", 205, 300)  # autograd's thread: no range parent
    mm = _event("aten::mm", 210, 220, id=2, parent=top)
    # the runtime call that launched a kernel shares its id and nests in the op; the first kernel is found by its
    # link to the op instead (no runtime call recorded)
    launch = _event("cudaLaunchKernel", 215, 218, id=71, parent=mm)
    no_phase = _event("Activity Buffer Request", 0, 1)  # id 0, like the profiler's own events: never a launcher
    kernels = [
        _event("memcpy HtoD", 150, 160, DeviceType.CUDA, id=70, linked=1),  # 150 us after the block's first host op
        _event("nvjet gemm", 300, 310, DeviceType.CUDA, id=71),  # 140 us after the copy
        _event("nvjet gemm", 310, 390, DeviceType.CUDA, id=72, linked=2),  # back to back: no gap
        _event("elementwise", 395, 400, DeviceType.CUDA, id=73, linked=2),  # 5 us: under the 20 us threshold
        _event("gpu_user_annotation", 150, 400, DeviceType.CUDA, annotation=True),  # a range, not a kernel
    ]
    return [no_phase, pack, copy, backward, top, mm, launch, *kernels]


def test_gaps_are_charged_to_the_phase_and_the_op_that_ended_them():
    gaps = idle_gaps(_events())
    assert gaps["gaps"] == 2
    assert abs(gaps["busy_s"] - 105e-6) < 1e-12 and abs(gaps["idle_s"] - 290e-6) < 1e-12
    assert abs(gaps["window_s"] - 400e-6) < 1e-12
    assert set(gaps["by_phase"]) == {"pack", "backward"}
    assert abs(gaps["by_phase"]["pack"][0] - 150e-6) < 1e-12 and gaps["by_phase"]["backward"][1] == 1
    assert set(gaps["by_op"]) == {"aten::copy_", "autograd::engine::evaluate_function: MmBackward0 > aten::mm"}
    first, second = gaps["largest"]
    assert first["before"] == "(block start)" and first["after"] == "memcpy HtoD" and first["offset_s"] == 0
    assert second["before"] == "memcpy HtoD" and abs(second["seconds"] - 140e-6) < 1e-12
    assert gaps["buckets"] == {"0.1-1 ms": [gaps["idle_s"], 2]}
    report = gap_report(gaps, block_s=0.5)
    assert "idle 0.000 s in 2 gaps" in report and "backward" in report and "largest gaps" in report


def test_no_kernels_no_gaps():
    host = [e for e in _events() if e.device_type == DeviceType.CPU]
    gaps = idle_gaps(host)
    assert gaps["gaps"] == 0 and gaps["idle_s"] == 0.0 and gaps["largest"] == []
