"""The GPU's clocks, power and temperature per step phase, read through NVML on a daemon thread.

The loop's generation and update can run slower than the same work alone, by an amount that changes from
machine to machine and from step to step. Clocks capped for power or heat after the update and a busy host
look alike in seconds; these readings tell them apart. Every `interval_s` the sampler reads this process's
device: the SM clock (MHz), the power draw (W; NVML averages it over about a second on Ampere and newer, so
a short phase's mean lags behind its start), the temperature (C) and the clock-event reasons. A reading
counts for every phase open when it was taken: a phase is a `perf/*_s` block that `rollout.base.timed`
times on the thread that started the sampler (generation, logprobs, scoring, update, refit). Per step and
phase (the perf key's name: `gen`, `train`, ...) the trainer logs `gpu/sm_clock_mhz_mean_<phase>`,
`gpu/sm_clock_mhz_min_<phase>`, `gpu/power_w_mean_<phase>`, `gpu/temp_c_max_<phase>`,
`gpu/throttled_frac_<phase>` (the share of readings with any of THROTTLE's reasons),
`gpu/power_capped_frac_<phase>`, `gpu/thermal_frac_<phase>`, `gpu/util_pct_mean_<phase>` and
`gpu/mem_util_pct_mean_<phase>` (NVML's utilization, the percent of its last sample period, 1/6 s to 1 s, in
which a kernel ran and in which device memory was read or written: a host-bound phase leaves gaps between
kernels where a phase of slower kernels does not; absent where NVML does not report it) and
`gpu/samples_<phase>`, reduced over ranks
(means over all ranks' readings, the lowest clock, the hottest reading); once, `gpu/sm_clock_max_mhz` and
`gpu/power_limit_w` (the lowest over ranks). A phase without a reading on any rank logs nothing.

The host side of the same phases, read at each phase's start and end: `host/process_cores_<phase>`, this
process's CPU seconds (every thread's, the in-process engine's too) over the phase's wall seconds, and
`host/other_cores_<phase>`, the machine's busy CPU seconds (Linux's /proc/stat, every core) less this
process's, over the same wall seconds: cores that other processes (other ranks on the node included) kept
busy meanwhile; and `host/main_thread_cores_<phase>`, the CPU seconds of the thread that times the phases (the
trainer's, which also drives the in-process engine) over the same wall seconds: the process's cores beyond it
are its other threads' (OpenMP's workers, spinning after a CPU op, among them). Means over ranks.

Python's cyclic garbage collector stops every Python thread of the process while it runs (the trainer's and
the in-process engine's alike); where it runs is the interpreter's choice. `host/gc_s_<phase>` is the seconds
it ran during the phase (all of the process's collections, whichever thread set them off), and
`host/gc_full_<phase>` how many of them were full (generation 2, which walks every object not frozen); means
over ranks. Read through `gc.callbacks` while the sampler is entered, from one clock (`gc_clock_on`,
`gc_seconds`) that the generation probe (rollout/gen_probe.py, `perf/gen_gc_s`) reads too.

Which threads those are: the first rank logs, per phase of each of the first 5 steps and of every 50th step
after (THREAD_LINE_STEPS, THREAD_LINE_EVERY), one line of the threads that kept more than 0.02 of a core busy
during it, busiest first (`threads in gen, cores: NAME CORES, NAME xN (busiest
CORES) CORES, ...`): a Python thread by its name, any other by the name the OS gives it
(Linux's /proc/self/task; none elsewhere) and the timed block by whose end it first appeared (`python3 from
engine_build`: `label_new_threads`), threads of one name summed with the busiest one's share; a thread that
ended before the phase did is not counted.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from models.phases import PHASE_PREFIX

log = logging.getLogger("vlrl")

# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*)
SW_POWER_CAP = 0x4  # the driver holds the clocks down to stay under the power limit
HW_SLOWDOWN = 0x8  # hardware halves the clocks or more: too hot, power brake or power draw too high
SW_THERMAL = 0x20  # the driver holds the clocks down to stay under the temperature limit
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80  # an external power brake (the system's power supply)
THROTTLE = SW_POWER_CAP | HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE
THERMAL = SW_THERMAL | HW_THERMAL
# per phase, summed over readings and ranks: readings, clock MHz, power W, throttled, power-capped, thermal, and
# NVML's utilization: the percent of its last sample period a kernel ran, and the device memory was read or written
_SUMS = ("samples", "clock", "power", "throttled", "power_capped", "thermal", "util", "mem_util")
_active: GpuTelemetry | None = None  # the started sampler, whose phases `phase` marks
THREAD_LINE_STEPS, THREAD_LINE_EVERY = 5, 50  # the thread lines: every one of the first steps, then every 50th


@contextmanager
def phase(key: str):
    """Mark `key` open for the started sampler's readings (`rollout.base.timed` wraps every timed block in it);
    nothing where no sampler runs, `key` is not one of its phases, or another thread times the block."""
    t = _active
    if t is None or key not in t.phases or threading.get_ident() != t.owner:
        yield
        return
    outer = t.open
    t.open = outer + (key,)  # one reference swapped: the sampler reads a whole tuple
    start, threads_at = host_clock(), time.monotonic()
    threads = thread_cpu() if t.reads_threads() else None
    try:
        yield
    finally:
        t.open = outer
        t.add_host(key, start, host_clock())
        if threads is not None:  # the wall around both readings: the threads' CPU while they were taken counts
            t.add_threads(key, threads, thread_cpu(), time.monotonic() - threads_at)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat's first line less idle and
    iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) * _TICK_S


_born: dict[int, str] = {}  # native thread id -> the timed block by whose end it was first seen


def label_new_threads(key: str) -> None:
    """Label the process's threads not seen before with `key`, the `rollout.base.timed` block ending now (the
    trainer's start-up blocks, then each step's phases): `thread_cpu` names a native thread the OS gives no name
    of its own by where it appeared (`python3 from engine_build`), which tells the engine's threads from the
    policy's and the data's."""
    try:
        ids = os.listdir("/proc/self/task")
    except OSError:
        return
    label = key.removeprefix("perf/").removesuffix("_s")
    for tid in ids:
        _born.setdefault(int(tid), label)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each of this process's threads by native id: (its name, CPU seconds so far). A Python thread's name is
    its `threading` name, any other's the OS's (/proc/self/task/<id>/comm) and, where `label_new_threads` saw
    it appear, the block it appeared in; empty where there is no /proc."""
    try:
        ids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    named = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in ids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        head, _, rest = stat.rpartition(")")  # the OS's name is in parentheses and may hold spaces or ')'
        fields = rest.split()  # from the state on: utime and stime are the stat's 14th and 15th fields
        if len(fields) < 13:
            continue
        name = named.get(int(tid))
        if name is None:
            name = head.partition("(")[2]
            if int(tid) in _born:
                name = f"{name} from {_born[int(tid)]}"
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * _TICK_S)
    return out


def thread_seconds(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]]) -> dict[tuple, float]:
    """CPU seconds each thread used between two `thread_cpu` readings, keyed (name, native id); a thread that
    started in between counts from zero."""
    out = {}
    for tid, (name, seconds) in end.items():
        before = start.get(tid)
        out[(name, tid)] = max(seconds - (before[1] if before is not None and before[0] == name else 0.0), 0.0)
    return out


def thread_cores(seconds: dict[tuple, float], wall: float) -> list[tuple[float, str]]:
    """Cores per thread name over `wall` seconds from `thread_seconds`' CPU seconds, busiest first: threads of one
    name summed, labelled `name xN (busiest C)` for N of them."""
    groups: dict[str, list[float]] = {}
    for (name, _), used in seconds.items():
        groups.setdefault(name, []).append(used)
    out = []
    for name, used in groups.items():
        total = sum(used) / wall
        label = name if len(used) == 1 else f"{name} x{len(used)} (busiest {max(used) / wall:.2f})"
        out.append((total, label))
    return sorted(out, reverse=True)


_gc_totals = [0.0, 0, 0.0]  # the collector's seconds and full collections so far, the running collection's start
_gc_users = [0]  # readers that turned the clock on (the sampler, generation probes): it runs while any is left


def _gc_clock(stage: str, info: dict) -> None:
    """gc.callbacks' hook: adds each collection's seconds, and counts the full ones (generation 2). Collections
    run one at a time, holding the interpreter's lock."""
    if stage == "start":
        _gc_totals[2] = time.perf_counter()
        return
    _gc_totals[0] += time.perf_counter() - _gc_totals[2]
    _gc_totals[1] += info.get("generation") == 2


def gc_clock_on() -> None:
    """One more reader of the garbage collector's clock (`gc_seconds`): it runs from the first reader's call to
    the last one's `gc_clock_off`."""
    _gc_users[0] += 1
    if _gc_clock not in gc.callbacks:
        gc.callbacks.append(_gc_clock)


def gc_clock_off() -> None:
    """One reader fewer; the clock stops with the last."""
    _gc_users[0] = max(_gc_users[0] - 1, 0)
    if not _gc_users[0] and _gc_clock in gc.callbacks:
        gc.callbacks.remove(_gc_clock)


def gc_seconds() -> float:
    """The garbage collector's seconds so far (counted while the clock runs); readers take differences."""
    return _gc_totals[0]


def host_clock() -> tuple[float, float, float | None, float, float, int]:
    """(wall, this process's CPU, the machine's busy CPU, this thread's CPU, the garbage collector's) seconds and
    the full collections so far, for a phase's host readings (the collector's only while a sampler is entered)."""
    return (time.monotonic(), time.process_time(), machine_busy_s(), time.thread_time(), _gc_totals[0],
            _gc_totals[1])


class GpuTelemetry:
    """NVML readings of one device, attributed to `phases` (perf keys), on a daemon thread while entered."""

    def __init__(self, nvml, handle, phases: tuple[str, ...], interval_s: float):
        self.nvml, self.handle, self.phases, self.interval_s = nvml, handle, tuple(phases), interval_s
        self.sm_clock_max_mhz = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        self.power_limit_w = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
        self._reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # the name before NVML 12.2
        try:  # NVML answers "not supported" for utilization on some devices (MIG instances): the rest still reads
            nvml.nvmlDeviceGetUtilizationRates(handle)
            self.has_util = True
        except Exception:
            self.has_util = False
        self.open: tuple[str, ...] = ()
        self.owner = threading.get_ident()
        self._lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}
        # per phase: wall s, process CPU s, machine busy CPU s, thread CPU s, collector s, full collections
        self._host: dict[str, list[float]] = {}
        self._threads: dict[str, dict[tuple, float]] = {}  # per phase: CPU s by (thread name, id) (add_threads)
        self._thread_wall: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first = True
        self._steps = 0  # step_metrics calls: the thread lines are logged for the first steps, then now and then

    def __enter__(self) -> GpuTelemetry:
        global _active
        self.owner, self._stop = threading.get_ident(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        _active = self
        gc_clock_on()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        gc_clock_off()
        self._stop.set()
        self._thread.join()  # NVML stays initialized: vLLM's own calls in this process use it too

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as e:  # an NVML error mid-run ends the readings, never the run
                log.warning("gpu telemetry stopped: NVML failed (%s: %s)", type(e).__name__, e)
                return

    def sample(self) -> None:
        """One reading, counted for every phase open now."""
        open_now = self.open
        if not open_now:
            return
        nvml, h = self.nvml, self.handle
        clock = float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
        power = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        temp = float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        reasons = int(self._reasons(h))
        util = nvml.nvmlDeviceGetUtilizationRates(h) if self.has_util else None
        row = (1.0, clock, power, float(bool(reasons & THROTTLE)), float(bool(reasons & SW_POWER_CAP)),
               float(bool(reasons & THERMAL)), float(util.gpu) if util is not None else 0.0,
               float(util.memory) if util is not None else 0.0)
        with self._lock:
            for key in open_now:
                s = self._stats.setdefault(key, [0.0] * len(_SUMS) + [clock, temp])
                s[:len(_SUMS)] = [a + b for a, b in zip(s, row)]
                s[-2], s[-1] = min(s[-2], clock), max(s[-1], temp)

    def add_host(self, key: str, start: tuple, end: tuple) -> None:
        """A phase's host readings, from `host_clock()` at its start and end (the machine's busy CPU counted as
        this process's alone where /proc/stat is missing)."""
        wall, cpu, thread = end[0] - start[0], end[1] - start[1], end[3] - start[3]
        busy = end[2] - start[2] if start[2] is not None and end[2] is not None else cpu
        s = self._host.setdefault(key, [0.0] * 6)
        for i, v in enumerate((wall, cpu, busy, thread, end[4] - start[4], end[5] - start[5])):
            s[i] += v

    def reads_threads(self) -> bool:
        """Whether this step's thread lines are logged (`step_metrics`), so its phases read the threads."""
        step = self._steps + 1
        return step <= THREAD_LINE_STEPS or step % THREAD_LINE_EVERY == 0

    def add_threads(self, key: str, start: dict, end: dict, wall: float) -> None:
        """A phase's CPU seconds by thread (`thread_cpu` at its start and end, `wall` seconds apart), summed over
        the step."""
        self._thread_wall[key] = self._thread_wall.get(key, 0.0) + wall
        into = self._threads.setdefault(key, {})
        for thread, seconds in thread_seconds(start, end).items():
            into[thread] = into.get(thread, 0.0) + seconds

    def thread_lines(self) -> list[str]:
        """This step's busy threads per phase (the module's docstring), and starts the next step's."""
        lines = []
        for key, seconds in self._threads.items():
            wall = self._thread_wall.get(key, 0.0)
            busy = [(c, label) for c, label in thread_cores(seconds, wall) if c > 0.02] if wall > 0 else []
            if busy:
                name = key.removeprefix("perf/").removesuffix("_s")
                lines.append(f"threads in {name}, cores: " + ", ".join(f"{label} {c:.2f}" for c, label in busy))
        self._threads, self._thread_wall = {}, {}
        return lines

    def step_metrics(self, device) -> dict[str, float]:
        """The step's gpu/* metrics over all ranks (a collective: every rank calls it); starts the next step's."""
        with self._lock:
            stats, self._stats = self._stats, {}
        host, self._host = self._host, {}
        logs = self.reads_threads()
        self._steps += 1
        lines = self.thread_lines()
        if logs and (not dist.is_initialized() or dist.get_rank() == 0):
            for line in lines:
                log.info(line)
        n = len(self.phases)
        # the readings' sums, then the host's: cores (process, elsewhere, main thread), ranks, collector s, full ones
        sums = torch.zeros(n, len(_SUMS) + 6, dtype=torch.float64)
        highs = torch.full((2 * n + 2,), -float("inf"), dtype=torch.float64)  # -clock min, temp max, -once values
        for i, key in enumerate(self.phases):
            if key in stats:
                sums[i, :len(_SUMS)] = torch.tensor(stats[key][:len(_SUMS)], dtype=torch.float64)
                highs[i], highs[n + i] = -stats[key][-2], stats[key][-1]
            wall, cpu, busy, thread, gc_s, gc_full = host.get(key, (0.0,) * 6)
            if wall > 0:  # this rank's cores for the phase, 1 to count the ranks that had it, its collector
                sums[i, len(_SUMS):] = torch.tensor([cpu / wall, max(busy - cpu, 0.0) / wall, thread / wall, 1.0,
                                                     gc_s, gc_full], dtype=torch.float64)
        highs[-2:] = torch.tensor([-self.sm_clock_max_mhz, -self.power_limit_w], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            sums, highs = sums.to(device), highs.to(device)
            dist.all_reduce(sums)
            dist.all_reduce(highs, op=dist.ReduceOp.MAX)
        sums, highs = sums.tolist(), highs.tolist()
        out = {}
        if self._first:
            out.update({"gpu/sm_clock_max_mhz": -highs[-2], "gpu/power_limit_w": -highs[-1]})
            self._first = False
        for i, key in enumerate(self.phases):
            count, clock, power, throttled, capped, thermal, util, mem_util = sums[i][:len(_SUMS)]
            own, other, main, ranks, gc_s, full = sums[i][len(_SUMS):]
            name = key.removeprefix("perf/").removesuffix("_s")
            if ranks:
                out.update({f"host/process_cores_{name}": own / ranks, f"host/other_cores_{name}": other / ranks,
                            f"host/main_thread_cores_{name}": main / ranks, f"host/gc_s_{name}": gc_s / ranks,
                            f"host/gc_full_{name}": full / ranks})
            if not count:
                continue
            out.update({f"gpu/sm_clock_mhz_mean_{name}": clock / count, f"gpu/sm_clock_mhz_min_{name}": -highs[i],
                        f"gpu/power_w_mean_{name}": power / count, f"gpu/temp_c_max_{name}": highs[n + i],
                        f"gpu/throttled_frac_{name}": throttled / count,
                        f"gpu/power_capped_frac_{name}": capped / count, f"gpu/thermal_frac_{name}": thermal / count,
                        f"gpu/samples_{name}": count})
            if self.has_util:
                out.update({f"gpu/util_pct_mean_{name}": util / count, f"gpu/mem_util_pct_mean_{name}": mem_util / count})
        return out


def _handle(nvml, device: torch.device):
    """NVML's handle for `device`: by the CUDA device's PCI bus id (CUDA_VISIBLE_DEVICES and CUDA's device order
    renumber devices, NVML does not), else its UUID, else by index; off CUDA, NVML's device 0."""
    if device.type != "cuda":
        return nvml.nvmlDeviceGetHandleByIndex(0)
    props = torch.cuda.get_device_properties(device)
    if getattr(props, "pci_bus_id", None) is not None:
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # e.g. a MIG instance or a driver that formats the id otherwise: try the UUID
            pass
    if getattr(props, "uuid", None) is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
        except Exception:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if device.index is None else device.index)


def build_telemetry(setting: str, device: torch.device, interval_s: float,
                    phases: tuple[str, ...]) -> GpuTelemetry | None:
    """The sampler for trainer.gpu_telemetry: `false` none; `auto` one on CUDA where NVML answers (else none,
    with one info line saying why); `true` one wherever NVML answers (off CUDA it reads NVML's device 0), else an
    error naming the key and what is missing."""
    if setting == "false":
        return None
    if setting == "auto" and device.type != "cuda":
        log.info("trainer.gpu_telemetry=auto: off (no CUDA device)")
        return None
    try:
        import pynvml
    except ImportError:
        if setting == "true":
            raise RuntimeError("config key 'trainer.gpu_telemetry' is true, but the pynvml module is missing: "
                               "pip install nvidia-ml-py (vLLM installs it), or set it to auto or false") from None
        log.info("trainer.gpu_telemetry=auto: off (the pynvml module, package nvidia-ml-py, is not installed)")
        return None
    try:
        pynvml.nvmlInit()
        telemetry = GpuTelemetry(pynvml, _handle(pynvml, device), phases, interval_s)
    except Exception as e:  # NVMLError: no driver, a device NVML does not know, a query it does not support
        if setting == "true":
            raise RuntimeError(f"config key 'trainer.gpu_telemetry' is true, but NVML failed on {device} "
                               f"({type(e).__name__}: {e}); set it to auto or false") from None
        log.info("trainer.gpu_telemetry=auto: off (NVML failed on %s: %s: %s)", device, type(e).__name__, e)
        return None
    log.info("trainer.gpu_telemetry=%s: on (%s; NVML every %.0f ms, max SM clock %.0f MHz, power limit %.0f W)",
             setting, device, 1000 * interval_s, telemetry.sm_clock_max_mhz, telemetry.power_limit_w)
    return telemetry


# the memory-bound ops (casts, copies, element-wise) whose input shapes tell which tensor each one reads
_SMALL_OPS = ("aten::copy_", "aten::mul", "aten::add_", "aten::add", "aten::_to_copy", "aten::cat", "aten::pow",
              "aten::mean", "aten::rsqrt", "aten::silu", "aten::neg", "aten::sum")


@contextmanager
def profiled(out: str | Path, label: str):
    """The block under torch.profiler, its op tables written to `out` after it: by self device time (CPU time
    without CUDA), on CUDA also by self CPU time and the casts, copies and element-wise ops by input shapes,
    under a first line with the wall seconds, the device kernels' busy seconds, the host's waits for the GPU
    (`cudaStreamSynchronize`) and the allocator's driver calls; on CUDA last, where the device sat idle between
    kernels and what its host was doing then (`idle_gaps`). Yields a dict that gets `host_syncs` (None without
    CUDA), `wall_s`, `block_s` (the block alone, without the profiler's stop and parsing) and on CUDA `busy_s` and
    `idle_s`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    result: dict = {}
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=True) as prof:
        yield result
        if cuda:
            torch.cuda.synchronize()
        inner = time.perf_counter() - t0  # the block alone; `wall` adds the profiler's stop and trace parsing
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # kernels and copies only: an op row also carries its kernels' time, a user range overlaps them
    busy = sum(e.self_device_time_total for e in events if getattr(e, "device_type", None) == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)) / 1e6 if cuda else 0.0
    # the host waiting for the GPU's queue to drain (a read back, a blocking copy): the GPU idles after each
    waits = [e for e in events if e.key == "cudaStreamSynchronize"]
    syncs, sync_s = sum(e.count for e in waits), sum(e.cpu_time_total for e in waits) / 1e6
    # the caching allocator going to the driver: a cudaFree waits for the device too (an allocation retry
    # frees the whole cache; an empty_cache between phases makes the next pass allocate again)
    driver = {name: sum(e.count for e in events if e.key == name) for name in ("cudaMalloc", "cudaFree")}
    head = (f"{label}: {wall:.2f} s wall (profiler overhead included), device kernels busy {busy:.2f} s"
            f" ({busy / wall:.0%} of wall), {syncs} cudaStreamSynchronize ({sync_s * 1e3:.0f} ms of host time),"
            f" {driver['cudaMalloc']} cudaMalloc, {driver['cudaFree']} cudaFree\n"
            if cuda else f"{label}: {wall:.2f} s wall\n")
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = [head, "--- by self device time ---" if cuda else "--- by self CPU time ---",
              events.table(sort_by=key, row_limit=45)]
    if cuda:  # a pass the GPU waits through is bound by the host: show where the host spends it
        tables += ["--- by self CPU time ---", events.table(sort_by="self_cpu_time_total", row_limit=25)]
        grouped = prof.key_averages(group_by_input_shape=True)
        rows = sorted((e for e in grouped if e.key in _SMALL_OPS), key=lambda e: -e.self_device_time_total)[:30]
        tables.append(f"--- casts, copies and element-wise ops by input shapes (top {len(rows)}) ---")
        tables += [f"{e.self_device_time_total / 1e3:10.1f} ms {e.count:7d}x  {e.key:16s} {e.input_shapes}"
                   for e in rows]
    events_list = prof.events()
    tables.append(phase_table(events_list))
    if cuda:
        gaps = idle_gaps(events_list)
        tables.append(gap_report(gaps, inner))
        result.update(idle_s=gaps["idle_s"], busy_s=gaps["busy_s"])
    Path(out).write_text("\n".join(tables) + "\n", encoding="utf-8")
    result.update(host_syncs=syncs if cuda else None, wall_s=wall, block_s=inner)


def phase_table(events) -> str:
    """The `vlrl: ` phase ranges of a profile (models.phases.phase_range): count and host wall time of each."""
    totals: dict[str, list] = {}
    for e in events:
        if e.name.startswith(PHASE_PREFIX):
            entry = totals.setdefault(e.name[len(PHASE_PREFIX):], [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e3
            entry[1] += 1
    lines = ["--- phases (vlrl: ranges; host wall time under the profiler, nested ranges counted in each) ---"]
    lines += [f"  {ms:10.1f} ms {n:6d}x  {name}" for name, (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    return "\n".join(lines)


def idle_gaps(events, min_gap_us: float = 20.0) -> dict:
    """Where the device waited on the host, from a profile's events (`profile.events()`).

    The device's kernels, copies and memsets, in start order, make its busy intervals; a gap of at least
    `min_gap_us` between them (and the lead from the block's first host op to the first kernel) is idle time.
    Each gap is charged to what ended it: the kernel after it, the host op that launched that kernel (by the
    profiler's correlation id) and that op's outermost op, and the innermost `vlrl: ` phase range open on any
    host thread when the op started (the backward's ops run on autograd's thread, its ranges on the caller's).
    Returns busy_s, idle_s, window_s, gaps (count), buckets ({label: [seconds, count]}), by_phase and by_op
    ({key: [seconds, count]}) and largest (the 12 longest gaps: seconds, offset_s, before, after, op).
    """
    from torch.autograd import DeviceType

    def device(e):
        return e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)

    kernels = sorted((e for e in events if device(e)), key=lambda e: e.time_range.start)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    # a kernel shares its correlation id with the runtime call that launched it (cudaLaunchKernel, cuLaunchKernelEx,
    # cudaMemcpyAsync, ...), which nests in the launching op on its thread; where the runtime call is missing, the
    # kernel's link to the op (newer torch) is the fallback
    runtime = {e.id: e for e in host if e.id and e.name.startswith("cu")}
    ops = {e.id: e for e in host if e.id and getattr(e, "linked_correlation_id", 0) == 0}
    phases = sorted((e for e in host if e.name.startswith(PHASE_PREFIX)), key=lambda e: e.time_range.start)
    out = {"busy_s": 0.0, "idle_s": 0.0, "window_s": 0.0, "gaps": 0, "buckets": {}, "by_phase": {}, "by_op": {},
           "largest": []}
    if not kernels:
        return out

    def phase_at(t: float) -> str:
        open_ = [p for p in phases if p.time_range.start <= t <= p.time_range.end]
        if not open_:
            return "(no phase)"
        inner = max(open_, key=lambda p: p.time_range.start)
        return inner.name[len(PHASE_PREFIX):]

    def launcher(k) -> tuple[str, float | None]:
        call = runtime.get(k.id) if getattr(k, "id", 0) else None
        op = getattr(call, "cpu_parent", None)
        if op is None:
            op = ops.get(getattr(k, "linked_correlation_id", 0) or -1)
        if op is None:
            return "(unknown op)", None if call is None else call.time_range.start
        when = call.time_range.start if call is not None else op.time_range.start
        top = op
        while getattr(top, "cpu_parent", None) is not None and not top.cpu_parent.name.startswith(PHASE_PREFIX):
            top = top.cpu_parent
        name = op.name if top is op else f"{top.name} > {op.name}"
        return name, when

    buckets = (("20-100 us", 100.0), ("0.1-1 ms", 1e3), ("1-10 ms", 1e4), (">= 10 ms", float("inf")))
    start = min([e.time_range.start for e in host] + [kernels[0].time_range.start])
    busy_end, busy, gaps = start, 0.0, []
    before = None
    for k in kernels:
        s, e = k.time_range.start, k.time_range.end
        if s - busy_end >= min_gap_us:
            gaps.append((s - busy_end, busy_end - start, before, k))
        if e > busy_end:
            busy += e - max(s, busy_end)
            busy_end = e
            before = k
    for length, offset, prev, k in gaps:
        name, launched = launcher(k)
        phase = phase_at(launched if launched is not None else k.time_range.start)
        for key, table in ((phase, out["by_phase"]), (name, out["by_op"])):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += length / 1e6
            entry[1] += 1
        label = next(lab for lab, top in buckets if length < top)
        entry = out["buckets"].setdefault(label, [0.0, 0])
        entry[0] += length / 1e6
        entry[1] += 1
    for length, offset, prev, k in sorted(gaps, key=lambda g: -g[0])[:12]:
        out["largest"].append({"seconds": length / 1e6, "offset_s": offset / 1e6,
                               "before": prev.name if prev is not None else "(block start)", "after": k.name,
                               "op": launcher(k)[0]})
    out.update(busy_s=busy / 1e6, window_s=(busy_end - start) / 1e6, gaps=len(gaps),
               idle_s=sum(g[0] for g in gaps) / 1e6)
    return out


def gap_report(gaps: dict, block_s: float) -> str:
    """`idle_gaps`' result as text for a profile file."""
    lines = [f"--- device idle: gaps between kernels (the host runs slower under the profiler, so more of it shows "
             f"here than in an unprofiled step) ---",
             f"block {block_s:.3f} s under the profiler; from its first host op to the last kernel "
             f"{gaps['window_s']:.3f} s: kernels busy {gaps['busy_s']:.3f} s, idle {gaps['idle_s']:.3f} s in "
             f"{gaps['gaps']} gaps of 20 us or more"]
    lines += [f"  {label:>10s}: {sec * 1e3:9.1f} ms in {n} gaps" for label, (sec, n) in gaps["buckets"].items()]
    for title, table in (("by phase (the vlrl: range open when the next kernel's op started)", gaps["by_phase"]),
                         ("by the op whose launch ended the gap (outermost op > launching op)", gaps["by_op"])):
        lines.append(title)
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:20]
        lines += [f"  {sec * 1e3:9.1f} ms {n:6d} gaps  {key[:150]}" for key, (sec, n) in rows]
    lines.append("largest gaps")
    lines += [f"  {g['seconds'] * 1e3:8.2f} ms at +{g['offset_s']:.3f} s  after {g['before'][:50]}  before "
              f"{g['after'][:50]}  launched by {g['op'][:100]}" for g in gaps["largest"]]
    return "\n".join(lines)
