"""GPU telemetry (rollout/telemetry.py) on a CPU, through a stand-in pynvml module with scripted readings:
readings count for the perf phase `timed` has open, the trainer logs them per phase as gpu/*, the thread ends
with the run, and the setting's auto/true/false mean what they say."""

import json
import os
import sys
import threading
import time
import types

import pytest
import torch

from grpo.config import ConfigError, load_config
from rollout import telemetry
from rollout.base import timed
from rollout.telemetry import HW_THERMAL, SW_POWER_CAP, build_telemetry
from tests.test_run_end import small_trainer

PHASES = ("perf/gen_s", "perf/logprob_s", "perf/train_s")


def fake_nvml(old_reason_name: bool = False) -> types.ModuleType:
    """A pynvml stand-in: each query returns `nvml.reading` (SM MHz, mW, C, clock-event reasons)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU = 1, 0
    nvml.reading = (1980, 500_000, 50, 0)
    nvml.util = (100, 40)  # NVML's utilization: kernels running, memory busy (percent)
    nvml.lookups = []
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: nvml.lookups.append(("index", i)) or "handle"
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nvml.nvmlDeviceGetClockInfo = lambda h, clock: nvml.reading[0]
    nvml.nvmlDeviceGetPowerUsage = lambda h: nvml.reading[1]
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: nvml.reading[2]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=nvml.util[0], memory=nvml.util[1])
    reasons = lambda h: nvml.reading[3]  # noqa: E731
    if old_reason_name:  # the name before NVML 12.2
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    else:
        nvml.nvmlDeviceGetCurrentClocksEventReasons = reasons
    return nvml


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "gpu-telemetry"]


@pytest.mark.parametrize("old_reason_name", [False, True])
def test_readings_count_for_the_phase_timed_has_open(monkeypatch, old_reason_name):
    nvml = fake_nvml(old_reason_name)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)  # the thread never reads: we do
    times = {}
    with t:
        assert _threads() == ["gpu-telemetry"]
        t.sample()  # no phase open: counted nowhere
        with timed(times, "perf/gen_s"):
            for reading, util in [((1410, 400_000, 55, 0), (90, 30)), ((1200, 690_000, 61, SW_POWER_CAP), (60, 12))]:
                nvml.reading, nvml.util = reading, util
                t.sample()
            with timed(times, "perf/wake_s"):  # not a phase: still generation's
                nvml.reading, nvml.util = (1000, 300_000, 58, HW_THERMAL), (30, 3)
                t.sample()
        with timed(times, "perf/train_s"):
            nvml.reading = (1980, 700_000, 70, 0)
            t.sample()
        first = t.step_metrics(torch.device("cpu"))
        with timed(times, "perf/train_s"):
            nvml.reading = (1500, 650_000, 66, SW_POWER_CAP | HW_THERMAL)
            t.sample()
        second = t.step_metrics(torch.device("cpu"))
    assert _threads() == []
    assert first["gpu/sm_clock_max_mhz"] == 1980 and first["gpu/power_limit_w"] == 700
    assert first["gpu/samples_gen"] == 3
    assert first["gpu/sm_clock_mhz_mean_gen"] == pytest.approx((1410 + 1200 + 1000) / 3)
    assert first["gpu/sm_clock_mhz_min_gen"] == 1000 and first["gpu/temp_c_max_gen"] == 61
    assert first["gpu/power_w_mean_gen"] == pytest.approx((400 + 690 + 300) / 3)
    assert first["gpu/throttled_frac_gen"] == pytest.approx(2 / 3)
    assert first["gpu/power_capped_frac_gen"] == pytest.approx(1 / 3)
    assert first["gpu/thermal_frac_gen"] == pytest.approx(1 / 3)
    assert first["gpu/util_pct_mean_gen"] == pytest.approx((90 + 60 + 30) / 3)
    assert first["gpu/mem_util_pct_mean_gen"] == pytest.approx((30 + 12 + 3) / 3)
    assert (first["gpu/util_pct_mean_train"], first["gpu/mem_util_pct_mean_train"]) == (30, 3)
    assert (first["gpu/samples_train"], first["gpu/sm_clock_mhz_mean_train"], first["gpu/throttled_frac_train"]) \
        == (1, 1980, 0)
    assert not [k for k in first if k.endswith(("_logprob", "_wake"))]  # no reading there: nothing logged
    # the next step starts afresh; the device's maxima come once
    assert sorted(second) == sorted(k for k in first if k.endswith("_train"))
    assert (second["gpu/sm_clock_mhz_mean_train"], second["gpu/power_w_mean_train"]) == (1500, 650)
    assert (second["gpu/power_capped_frac_train"], second["gpu/thermal_frac_train"]) == (1, 1)


def test_a_phase_s_host_cores_come_from_its_start_and_end(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)
    # (wall, this process's CPU, the machine's busy CPU, this thread's CPU, the collector's) seconds and the full
    # collections so far, at each phase's start and end
    clocks = iter([(0.0, 0.0, 10.0, 0.0, 0.0, 0), (2.0, 1.5, 14.0, 1.0, 0.3, 1),  # gen: 0.75 cores here (0.5 this
                   # thread's), 1.25 elsewhere; the collector 0.3 s, one full collection
                   (5.0, 2.0, 20.0, 1.2, 0.3, 1), (6.0, 3.0, 21.0, 2.0, 0.35, 1),  # train, twice in the step: summed
                   (7.0, 3.0, 22.0, 2.0, 0.35, 1), (8.0, 3.5, None, 2.4, 0.45, 3)])  # no /proc/stat at the end
    monkeypatch.setattr(telemetry, "host_clock", lambda: next(clocks))
    times = {}
    with t:
        with timed(times, "perf/gen_s"):
            with timed(times, "perf/wake_s"):  # not a phase: no readings of its own
                pass
        for _ in range(2):
            with timed(times, "perf/train_s"):
                pass
        m = t.step_metrics(torch.device("cpu"))
        after = t.step_metrics(torch.device("cpu"))
    assert m["host/process_cores_gen"] == pytest.approx(0.75) and m["host/other_cores_gen"] == pytest.approx(1.25)
    assert m["host/process_cores_train"] == pytest.approx(1.5 / 2) and m["host/other_cores_train"] == pytest.approx(0)
    assert m["host/main_thread_cores_gen"] == pytest.approx(0.5)
    assert m["host/main_thread_cores_train"] == pytest.approx((0.8 + 0.4) / 2)
    assert m["host/gc_s_gen"] == pytest.approx(0.3) and m["host/gc_full_gen"] == 1
    assert m["host/gc_s_train"] == pytest.approx(0.15) and m["host/gc_full_train"] == 2
    assert not [k for k in m if k.startswith("host/") and k.endswith(("_logprob", "_wake"))]
    assert not [k for k in after if k.startswith("host/")]  # the next step starts afresh



def collect_cycles() -> None:
    """Make 20,000 lists in reference cycles (only the cyclic collector frees them) and run a full collection."""
    import gc

    junk = [[] for _ in range(20000)]
    for a, b in zip(junk, junk[1:]):
        a.append(b)
        b.append(a)
    del junk, a, b
    gc.collect()


def test_the_garbage_collector_s_pauses_count_for_the_phase_it_ran_in(monkeypatch):
    """A full collection inside a phase is timed and counted for it, through gc.callbacks while the sampler runs;
    the hook is gone after."""
    import gc

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)
    times = {}
    users = telemetry._gc_users[0]
    gc.disable()  # only the collections the test asks for: none that the allocations below would trigger
    try:
        with t:
            assert telemetry._gc_clock in gc.callbacks and telemetry._gc_users[0] == users + 1
            with timed(times, "perf/gen_s"):
                collect_cycles()
                gc.collect(0)
            with timed(times, "perf/train_s"):
                pass
            m = t.step_metrics(torch.device("cpu"))
    finally:
        gc.enable()
    assert telemetry._gc_users[0] == users and (users or telemetry._gc_clock not in gc.callbacks)
    assert m["host/gc_full_gen"] == 1 and 0 < m["host/gc_s_gen"] <= times["perf/gen_s"]
    assert m["host/gc_full_train"] == 0 and m["host/gc_s_train"] < m["host/gc_s_gen"]


def test_the_machine_s_busy_cpu_reads_proc_stat():
    busy = telemetry.machine_busy_s()
    if not os.path.exists("/proc/stat"):
        assert busy is None
        return
    time.sleep(0.01)
    end = time.monotonic() + 0.2
    while time.monotonic() < end:  # keep a core busy
        pass
    assert telemetry.machine_busy_s() - busy >= 0.1


def _timed_sleep(times: dict, key: str, seconds: float) -> None:
    with timed(times, key):
        time.sleep(seconds)


def test_the_thread_reads_while_a_phase_is_open_and_ends_with_the_block(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    t = build_telemetry("true", torch.device("cpu"), 0.005, PHASES)
    times = {}
    with pytest.raises(KeyError):  # however the run ends
        with t:
            _timed_sleep(times, "perf/gen_s", 0.3)
            other = threading.Thread(target=_timed_sleep, args=(times, "perf/train_s", 0.1))
            other.start()  # a block timed on another thread (a prefetch's) marks no phase
            other.join()
            m = t.step_metrics(torch.device("cpu"))
            raise KeyError("stop")
    assert _threads() == []
    assert m["gpu/samples_gen"] >= 5 and m["gpu/sm_clock_mhz_mean_gen"] == 1980 and "gpu/samples_train" not in m


def test_a_device_without_utilization_still_logs_the_rest(monkeypatch):
    """NVML answers "not supported" for utilization on some devices (MIG instances): the clocks and the rest are
    still read and logged, the utilization keys left out."""
    nvml = fake_nvml()

    def unsupported(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nvml.nvmlDeviceGetUtilizationRates = unsupported
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)
    with t:
        with timed({}, "perf/train_s"):
            t.sample()
        row = t.step_metrics(torch.device("cpu"))
    assert (row["gpu/samples_train"], row["gpu/sm_clock_mhz_mean_train"]) == (1, 1980)
    assert not [k for k in row if "util" in k]


def test_auto_is_off_without_cuda_or_pynvml_and_true_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    assert build_telemetry("auto", torch.device("cpu"), 0.05, PHASES) is None  # no CUDA device
    assert build_telemetry("false", torch.device("cpu"), 0.05, PHASES) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert build_telemetry("auto", torch.device("cuda", 0), 0.05, PHASES) is None
    with pytest.raises(RuntimeError, match=r"'trainer.gpu_telemetry' is true.*pynvml.*nvidia-ml-py"):
        build_telemetry("true", torch.device("cpu"), 0.05, PHASES)
    broken = fake_nvml()

    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with pytest.raises(RuntimeError, match=r"'trainer.gpu_telemetry' is true, but NVML failed.*Not Found"):
        build_telemetry("true", torch.device("cpu"), 0.05, PHASES)
    assert telemetry._active is None and _threads() == []


def test_the_cuda_device_is_found_by_its_pci_bus_id_then_uuid_then_index(monkeypatch):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0, uuid="0b42632a-bc5c")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    nvml = fake_nvml()
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: nvml.lookups.append(("pci", bus)) or "by-pci"
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: nvml.lookups.append(("uuid", uuid)) or "by-uuid"
    assert telemetry._handle(nvml, torch.device("cuda", 1)) == "by-pci"

    def unknown(key):
        raise KeyError(key)

    nvml.nvmlDeviceGetHandleByPciBusId = unknown
    assert telemetry._handle(nvml, torch.device("cuda", 1)) == "by-uuid"
    nvml.nvmlDeviceGetHandleByUUID = unknown
    assert telemetry._handle(nvml, torch.device("cuda", 1)) == "handle"
    assert nvml.lookups == [("pci", "00000000:3b:00.0"), ("uuid", "GPU-0b42632a-bc5c"), ("index", 1)]


def test_the_config_keys():
    assert load_config(None, []).trainer.gpu_telemetry == "auto"
    assert load_config(None, ["trainer.gpu_telemetry=true"]).trainer.gpu_telemetry == "true"  # a boolean reads
    assert load_config(None, ["trainer.gpu_telemetry=false"]).trainer.gpu_telemetry == "false"
    with pytest.raises(ConfigError, match="trainer.gpu_telemetry_interval_s' must be > 0"):
        load_config(None, ["trainer.gpu_telemetry_interval_s=0"])


def _trainer(model, data, run_dir, *extra):
    return small_trainer(model, data, run_dir, "checkpoint.at_end=false", "trainer.max_steps=2", *extra)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_logs_each_phase_s_readings(tiny_model, clevr_parquet, tmp_path, monkeypatch):
    from grpo.trainer import Trainer
    from rollout.rollouts import Rollouts

    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    running = []

    def reading(value, method):
        def wrapped(self, *args, **kwargs):
            nvml.reading = value
            for _ in range(2):  # the thread's interval is an hour: these are the only readings
                trainer.telemetry.sample()
            running.append(_threads())
            return method(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(Rollouts, "collect", reading((1200, 650_000, 60, SW_POWER_CAP), Rollouts.collect))
    monkeypatch.setattr(Trainer, "_ppo_update", reading((1900, 700_000, 70, 0), Trainer._ppo_update))
    trainer = _trainer(tiny_model, clevr_parquet, tmp_path / "run", "trainer.gpu_telemetry=true",
                       "trainer.gpu_telemetry_interval_s=3600")
    trainer.train()
    assert running == [["gpu-telemetry"]] * 4 and _threads() == []
    first, second = _rows(tmp_path / "run")
    assert (first["gpu/sm_clock_max_mhz"], first["gpu/power_limit_w"]) == (1980, 700)
    assert "gpu/sm_clock_max_mhz" not in second
    for row in (first, second):
        gen = [row[f"gpu/{k}_gen"] for k in ("samples", "sm_clock_mhz_mean", "sm_clock_mhz_min", "power_w_mean",
                                               "temp_c_max", "throttled_frac", "power_capped_frac", "thermal_frac")]
        train = [row[f"gpu/{k}_train"] for k in ("samples", "sm_clock_mhz_mean", "power_w_mean", "temp_c_max",
                                                   "throttled_frac")]
        assert gen == [2, 1200, 1200, 650, 60, 1, 1, 0] and train == [2, 1900, 700, 70, 0]
        # no reading taken there: no gpu/* keys; the host's come from each phase's start and end
        assert not [k for k in row if k.startswith("gpu/") and k.endswith(("_logprob", "_refit", "_score"))]
        for phase in ("gen", "logprob", "train", "refit"):
            assert row[f"host/process_cores_{phase}"] >= 0 and row[f"host/other_cores_{phase}"] >= 0


def test_auto_on_a_cpu_logs_no_gpu_metrics_and_starts_no_thread(tiny_model, clevr_parquet, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    trainer = _trainer(tiny_model, clevr_parquet, tmp_path / "run", "trainer.max_steps=1")
    assert trainer.telemetry is None
    trainer.train()
    (row,) = _rows(tmp_path / "run")
    assert not [k for k in row if k.startswith("gpu/")] and _threads() == []
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(RuntimeError, match="'trainer.gpu_telemetry' is true, but the pynvml module is missing"):
        _trainer(tiny_model, clevr_parquet, tmp_path / "run2", "trainer.gpu_telemetry=true")


# a pynvml stand-in for train.py's processes: each rank's device reads differently
RANK_NVML = '''import os
RANK = int(os.environ.get("RANK", 0))  # torch.cuda imports pynvml in the launcher too
NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
nvmlInit = lambda: None
nvmlDeviceGetHandleByIndex = lambda i: "handle"
nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980 - 10 * RANK
nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000 - 50_000 * RANK
nvmlDeviceGetClockInfo = lambda h, clock: 1000 + 500 * RANK
nvmlDeviceGetPowerUsage = lambda h: 600_000
nvmlDeviceGetTemperature = lambda h, sensor: 50 + 20 * RANK
nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 * RANK
nvmlDeviceGetUtilizationRates = lambda h: type("Utilization", (), {"gpu": 80 - 40 * RANK, "memory": 20 + 40 * RANK})
'''


@pytest.mark.slow
def test_two_ranks_reduce_their_readings(tiny_model, clevr_parquet, tmp_path):
    from tests.conftest import ROOT, run_torchrun

    (tmp_path / "nvml").mkdir()
    (tmp_path / "nvml" / "pynvml.py").write_text(RANK_NVML)
    run = tmp_path / "run"
    run_torchrun(["train.py", "--config", "configs/demo.yaml", f"model.path={tiny_model}",
                  f"data.train_path={clevr_parquet}", "data.eval_path=", f"trainer.run_dir={run}",
                  "trainer.max_steps=2", "trainer.eval_every=0", "data.prompts_per_step=4", "rollout.n=4",
                  "rollout.max_new_tokens=8", "data.min_pixels=3136", "data.max_pixels=3136",
                  "logging.tensorboard=false", "checkpoint.at_end=false", "trainer.gpu_telemetry=true",
                  "trainer.gpu_telemetry_interval_s=0.002"],
                 env={"PYTHONPATH": f"{tmp_path / 'nvml'}:{ROOT}"})
    first, second = _rows(run)
    assert (first["gpu/sm_clock_max_mhz"], first["gpu/power_limit_w"]) == (1970, 650)  # the lower rank's
    for row in (first, second):  # rank 0: 1000 MHz, 50 C, unthrottled; rank 1: 1500 MHz, 70 C, power-capped
        assert row["gpu/sm_clock_mhz_min_gen"] == 1000 and row["gpu/temp_c_max_gen"] == 70
        assert 1000 < row["gpu/sm_clock_mhz_mean_gen"] < 1500 and 0 < row["gpu/power_capped_frac_gen"] < 1
        assert row["gpu/power_w_mean_gen"] == 600 and row["gpu/thermal_frac_gen"] == 0
        assert 40 < row["gpu/util_pct_mean_gen"] < 80 and 20 < row["gpu/mem_util_pct_mean_gen"] < 60


def test_a_phase_logs_the_threads_that_kept_cores_busy(monkeypatch, caplog):
    """The step's line per phase names each thread busier than 0.02 of a core, busiest first: a thread that
    spins through most of the phase shows near one core, the sleeping main thread does not show."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task")
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)
    stop, started = threading.Event(), threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner")
    times = {}
    with t:
        spinner.start()
        started.wait()
        with timed(times, "perf/gen_s"):
            time.sleep(0.5)
        stop.set()
        spinner.join()
        with timed(times, "perf/train_s"):  # the spinner gone: not in this phase's line
            time.sleep(0.3)
        with caplog.at_level("INFO", logger="vlrl"):
            t.step_metrics(torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("threads in")]
    assert lines and lines[0].startswith("threads in gen, cores: spinner ")
    assert not [line for line in lines[1:] if "spinner" in line]
    cores = float(lines[0].split("spinner ")[1].split(",")[0])
    assert 0.5 <= cores <= 1.05
    assert "MainThread" not in lines[0]
    assert t.thread_lines() == []  # the next step starts afresh


def test_thread_cores_sums_threads_of_one_name_and_counts_new_ones_from_zero():
    start = {1: ("MainThread", 10.0), 2: ("python3", 1.0)}
    end = {1: ("MainThread", 11.0), 2: ("python3", 1.5), 3: ("python3", 0.5), 4: ("pt_worker", 0.25)}
    seconds = telemetry.thread_seconds(start, end)
    assert seconds == {("MainThread", 1): 1.0, ("python3", 2): 0.5, ("python3", 3): 0.5, ("pt_worker", 4): 0.25}
    assert telemetry.thread_cores(seconds, 2.0) == [(0.5, "python3 x2 (busiest 0.25)"), (0.5, "MainThread"),
                                                    (0.125, "pt_worker")]


def test_a_native_thread_is_named_by_the_timed_block_it_appeared_in(monkeypatch):
    """`timed` labels threads first seen at a block's end: a thread without a Python name (as a C library's),
    started inside a block, reads as `<its OS name> from <that block>`; a Python thread keeps its own name."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/self/task")
    times, stop, ready = {}, threading.Event(), threading.Event()
    with timed(times, "perf/policy_build_s"):
        pass
    info = {}

    def native():
        info["tid"] = threading.get_native_id()
        ready.set()
        stop.wait()

    t = threading.Thread(target=native)
    with timed(times, "perf/engine_build_s"):
        t.start()
        ready.wait()
    try:
        main = threading.main_thread()
        monkeypatch.setattr(telemetry.threading, "enumerate", lambda: [main])  # `t` unknown to Python, as a C thread
        names = {tid: name for tid, (name, _) in telemetry.thread_cpu().items()}
        with open(f"/proc/self/task/{info['tid']}/comm") as f:
            comm = f.read().strip()
        assert names[info["tid"]] == f"{comm} from engine_build"
        assert names[main.native_id] == "MainThread"
    finally:
        stop.set()
        t.join()


def test_thread_lines_are_logged_for_the_first_steps_then_every_so_often(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(telemetry, "THREAD_LINE_STEPS", 2)
    monkeypatch.setattr(telemetry, "THREAD_LINE_EVERY", 3)
    t = build_telemetry("true", torch.device("cpu"), 3600.0, PHASES)
    logged = []
    with t:
        for _ in range(6):
            t._threads, t._thread_wall = {"perf/gen_s": {("spinner", 1): 0.5}}, {"perf/gen_s": 1.0}
            caplog.clear()
            with caplog.at_level("INFO", logger="vlrl"):
                t.step_metrics(torch.device("cpu"))
            logged.append(any(r.getMessage() == "threads in gen, cores: spinner 0.50" for r in caplog.records))
    assert logged == [True, True, True, False, False, True]  # steps 1-2, then 3 and 6
    times = {}
    with t:  # step 7's phases read no threads (nothing to log); step 9's do
        with timed(times, "perf/gen_s"):
            pass
        assert not t._threads
        t._steps = 8
        with timed(times, "perf/gen_s"):
            pass
        assert "perf/gen_s" in t._threads
