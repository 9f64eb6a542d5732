"""rollout/gen_probe.py: the generation breakdown's wrappers on stand-ins of vLLM 0.26's objects, its nulls for
what is missing or fails, and the trainer's perf/gen_* metrics of a step's calls."""

import gc
import sys
import time
import types
from types import SimpleNamespace as NS

import pytest
import torch

from rollout.gen_probe import METRICS, GenerationProbe, breakdown_metrics


def _fake_timing_context(monkeypatch):
    """vLLM's multimodal TimingContext, as a stand-in module tree (no vLLM here)."""

    class TimingContext:
        def __init__(self, enabled=True):
            self.enabled, self.stage_secs = enabled, {}

    names = ("vllm", "vllm.multimodal", "vllm.multimodal.processing", "vllm.multimodal.processing.context")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].TimingContext = TimingContext
    return TimingContext


def _engine(scheduler_steps, encoder_calls):
    """An engine whose vLLM stand-in has a renderer's processor, a scheduler and a V2 runner's encoder."""

    class Processor:
        def apply(self, inputs, timing_ctx):
            timing_ctx.stage_secs["apply_hf_processor_secs"] = 0.25
            timing_ctx.stage_secs["get_mm_hashes_secs"] = 0.5
            return self._get_cache_missing_items(inputs)

        def _get_cache_missing_items(self, inputs):
            return {"image": [True, False, False]}, inputs

    scheduler = NS(requests={})
    scheduler.schedule = lambda: scheduler_steps.pop(0)
    encoder = NS(execute_mm_encoder=lambda *a: encoder_calls.append(a))
    worker = NS(worker=NS(model_runner=NS(model_state=NS(encoder_runner=encoder))))
    core = NS(scheduler=scheduler, model_executor=NS(driver_worker=worker))
    processor = Processor()

    class LLM:
        def _add_completion_requests(self, prompts):
            for p in prompts:
                self.llm_engine.renderer.mm_processor.apply(p, None)

        def _run_engine(self):  # vLLM's LLMEngine.step: the engine core's step, then the outputs' processing
            while scheduler_steps:
                self.llm_engine.output_processor.process_outputs(self.llm_engine.engine_core.get_output())

    def get_output():
        scheduler.schedule()
        encoder.execute_mm_encoder("pixels")
        return []

    def process_outputs(outputs):
        time.sleep(0.002)

    llm = LLM()
    llm.llm_engine = NS(engine_core=NS(engine_core=core, get_output=get_output), renderer=NS(mm_processor=processor),
                        output_processor=NS(process_outputs=process_outputs))
    engine = NS(_llm=llm, _vllm_prompt=lambda i, p: p)
    return engine, llm


def _step(tokens: dict, images: int = 0):
    return NS(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
              scheduled_encoder_input_stats=NS(num_inputs=images, output_tokens=images * 16), preempted_req_ids=None)


def test_probe_times_and_counts_every_part_it_finds(monkeypatch):
    _fake_timing_context(monkeypatch)
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    steps = [_step({"a": 40, "b": 1}, images=2), _step({"a": 1, "b": 1}), _step({"a": 1})]
    encoded = []
    engine, llm = _engine(steps, encoded)
    probe = GenerationProbe(engine)  # training's: no GPU synchronization
    try:
        probe.begin()
        engine._vllm_prompt(0, NS(images=["x", "y"]))
        llm._add_completion_requests(["p0", "p1"])
        llm._run_engine()
        out = probe.report({"prompt_tokens": 9, "cached_prompt_tokens": 3})
    finally:
        probe.close()
    assert probe.missing == set() and syncs == [] and len(encoded) == 3
    assert out["mm_stage_s"] == {"apply_hf_processor": 0.5, "get_mm_hashes": 1.0}  # two requests' stages
    assert out["images_processed"] == 4 and out["images_sent"] == 2  # two misses per request
    assert (out["steps"], out["prefill_steps"], out["prefill_tokens"], out["scheduled_tokens"]) == (3, 1, 40, 44)
    assert out["images_encoded"] == 2 and out["encoder_embeds"] == 32 and out["preempted"] == 0
    assert out["encoder_s"] >= 0 and out["encoder_synced"] is False and len(out["slowest_steps_s"]) == 2
    assert out["outputs_s"] >= 0.006 and 0 <= out["core_s"]
    assert out["core_s"] + out["outputs_s"] <= out["steps_s"] + 0.002  # each rounded to ms
    assert out["prompt_tokens"] == 9 and out["input_s"] is None


def test_synced_probe_waits_for_the_gpu_around_the_encoder(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    engine, llm = _engine([_step({"a": 1}), _step({"a": 1})], [])
    probe = GenerationProbe(engine, synced=True)  # tools/bench_turns.py's
    try:
        probe.begin()
        llm._run_engine()
        out = probe.report()
    finally:
        probe.close()
    assert len(syncs) == 4 and out["encoder_synced"] is True and out["encoder_s"] >= 0


def test_missing_parts_read_null_and_nothing_is_wrapped():
    engine = NS(_llm=None)  # no vLLM objects at all
    probe = GenerationProbe(engine)
    try:
        probe.begin()
        out = probe.report()
    finally:
        probe.close()
    assert {k for k, v in out.items() if v is not None} == {"encoder_synced", "gc_s"}  # gc: Python's own
    assert breakdown_metrics(out) == {"perf/gen_gc_s": 0.0}
    assert not hasattr(engine, "_vllm_prompt")


def test_mm_stages_read_null_without_vllm_s_timer(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM: its TimingContext cannot be imported
    engine, llm = _engine([], [])
    original = llm.llm_engine.renderer.mm_processor.apply
    probe = GenerationProbe(engine)
    probe.close()
    assert "mm_stage_s" in probe.missing and llm.llm_engine.renderer.mm_processor.apply == original
    assert probe.report()["mm_stage_s"] is None and probe.report()["images_processed"] == 0


def test_a_counting_failure_reads_null_and_generation_goes_on():
    odd = NS(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens="many")  # not what vLLM 0.26 gives
    engine, llm = _engine([odd, _step({"a": 1})], [])
    probe = GenerationProbe(engine)
    try:
        probe.begin()
        llm._run_engine()  # no exception reaches the engine
        out = probe.report()
    finally:
        probe.close()
    assert out["steps"] is None and out["slowest_steps_s"] is None and out["preempted"] is None
    assert out["steps_s"] >= 0 and out["images_processed"] is not None


def test_garbage_collection_counts_only_inside_a_call():
    """The probe reads the collector's clock that the telemetry sampler reads too (rollout.telemetry): on from the
    probe's making to its close, unless the sampler still runs; a call's gc_s is the clock's seconds in it."""
    from rollout import telemetry
    from tests.test_telemetry import collect_cycles as cycles

    users = telemetry._gc_users[0]
    probe = GenerationProbe(NS(_llm=None))
    try:
        assert telemetry._gc_clock in gc.callbacks and telemetry._gc_users[0] == users + 1
        cycles()  # before any call: not counted
        probe.begin()
        cycles()
        inside = probe.report()["gc_s"]
        cycles()  # between calls: not counted
        probe.begin()
        assert inside > 0 and probe.report()["gc_s"] < inside
        other = GenerationProbe(NS(_llm=None))
        other.close()
        other.close()  # a second close releases nothing more
        assert telemetry._gc_clock in gc.callbacks  # the first probe still reads it
    finally:
        probe.close()
    assert telemetry._gc_users[0] == users and (users or telemetry._gc_clock not in gc.callbacks)


def _breakdown(**overrides):
    out = {"input_s": None, "prep_s": 0.1, "add_s": 0.5, "steps_s": 2.0, "core_s": 1.7, "outputs_s": 0.2,
           "encoder_s": 0.2, "gc_s": 0.01,
           "encoder_synced": False, "mm_stage_s": {"get_mm_hashes": 0.1, "apply_hf_processor": 0.2},
           "images_sent": 4, "images_processed": 2, "images_encoded": 2, "encoder_embeds": 32, "steps": 100,
           "prefill_steps": 2, "scheduled_tokens": 900, "prefill_tokens": 300, "preempted": 0,
           "slowest_steps_s": [0.05, 0.01, 0.01], "prompt_tokens": 300, "cached_prompt_tokens": 0}
    out.update(overrides)
    return out


def test_breakdown_metrics_of_one_call():
    m = breakdown_metrics(_breakdown())
    continuous = {"gen_follow_s", "gen_poll_s", "gen_tool_wait_s"}  # a generate_continuing call's alone
    assert set(m) == {f"perf/{k}" for k in METRICS if k not in continuous}
    assert m["perf/gen_prep_s"] == 0.1 and m["perf/gen_steps"] == 100.0 and m["perf/gen_preempted"] == 0.0
    assert m["perf/gen_mm_processor_s"] == pytest.approx(0.3) and m["perf/gen_slowest_step_s"] == 0.05
    assert m["perf/gen_images_processed"] == 2.0 and m["perf/gen_prefill_steps"] == 2.0


def test_breakdown_metrics_sum_a_multi_turn_step_s_calls():
    turns = [_breakdown(), _breakdown(steps=50, add_s=1.5, slowest_steps_s=[0.2], preempted=3, mm_stage_s={}),
             _breakdown(slowest_steps_s=[])]
    m = breakdown_metrics(turns)
    assert m["perf/gen_steps"] == 250.0 and m["perf/gen_add_s"] == pytest.approx(2.5)
    assert m["perf/gen_preempted"] == 3.0 and m["perf/gen_slowest_step_s"] == 0.2  # the longest of any call
    assert m["perf/gen_mm_processor_s"] == pytest.approx(0.6) and m["perf/gen_steps_s"] == pytest.approx(6.0)


def test_breakdown_metrics_leave_out_what_reads_null():
    nulls = dict(mm_stage_s=None, images_processed=None, steps=None, prefill_steps=None, preempted=None,
                 slowest_steps_s=None, core_s=None, outputs_s=None)
    m = breakdown_metrics([_breakdown(**nulls), {}])
    assert set(m) == {"perf/gen_prep_s", "perf/gen_add_s", "perf/gen_steps_s", "perf/gen_gc_s"}
    assert breakdown_metrics([]) == {} and breakdown_metrics(None) == {}
    assert breakdown_metrics([_breakdown(slowest_steps_s=[])])["perf/gen_slowest_step_s"] == 0.0


def test_breakdown_metrics_carry_a_continuous_call_s_tool_times():
    m = breakdown_metrics([_breakdown(follow_s=0.25, poll_s=0.5, tool_wait_s=1.0)])
    assert (m["perf/gen_follow_s"], m["perf/gen_poll_s"], m["perf/gen_tool_wait_s"]) == (0.25, 0.5, 1.0)
    assert "perf/gen_tool_wait_s" not in breakdown_metrics([_breakdown()])  # turn by turn: none


def test_rollouts_keep_each_call_s_breakdown_for_the_step():
    """Rollouts.generate collects the engine's last_breakdown of every call; a step's collect starts anew."""
    from rollout.groups import EngineGroup
    from rollout.rollouts import Rollouts

    class Engine:
        last_stats = {}
        last_breakdown = {}

        def generate(self, inputs, params):
            self.last_breakdown = _breakdown(steps=len(inputs))
            return []

    rollouts = Rollouts.__new__(Rollouts)
    rollouts.engine_group, rollouts.prefix, rollouts.breakdowns = EngineGroup(), [0, 0], []
    engine = Engine()
    rollouts.generate(engine, ["a", "b"], NS(n=1))
    rollouts.generate(engine, ["a"], NS(n=1))
    assert [b["steps"] for b in rollouts.breakdowns] == [2, 1]
    assert breakdown_metrics(rollouts.breakdowns)["perf/gen_steps"] == 3.0
    rollouts.generate(NS(generate=lambda i, p: [], last_breakdown={}), ["a"], NS(n=1))  # a torch engine: none
    assert len(rollouts.breakdowns) == 2
