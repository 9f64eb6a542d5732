"""Where a vLLM generate call's time goes: wrappers on one `VLLMEngine`'s in-process vLLM 0.26 objects.

`GenerationProbe` times and counts the parts of each generate call. `VLLMEngine` installs one under
`rollout.gen_breakdown` (on by default) and keeps each call's breakdown as `engine.last_breakdown`; the
trainer sums a step's calls into `perf/gen_*` metrics (`breakdown_metrics`). `tools/bench_turns.py`
reports it per turn. Each wrapper is installed only where vLLM has the object, and a part it cannot find
(or whose counting fails) reads null: the probe never stops a generate call.

A breakdown (`GenerationProbe.report`):
  prep_s           the engine's own prompt building (collapse, re-expansion check, image keys)
  add_s            vLLM taking the requests: its multimodal processor and the engine core's add
  mm_stage_s       add_s's multimodal processor by stage (get_mm_hashes, apply_hf_processor, ...)
  steps_s          vLLM's engine steps (schedule, forward, sample) until every request finished
  core_s           steps_s's engine core (scheduling, the model's step and sampling, the scheduler's update):
                   what a standalone `LLM` runs in an engine-core process of its own
  outputs_s        steps_s's output processing (each step's new tokens and logprobs into the requests): what a
                   standalone `LLM` runs beside the engine core, in its calling process; here the same thread
  encoder_s        the vision encoder's calls inside the steps: with `synced` (the benchmark) the GPU is
                   synchronized around each call, so its kernels count; without (training runs: no
                   added syncs) the host's seconds in the calls (`encoder_synced` says which)
  gc_s             Python garbage collection during the call
  slowest_steps_s  the three longest intervals between consecutive scheduler calls (one step each): a
                   stall inside one step (a collection, a pinned-memory allocation) shows here
  images_sent, images_processed (the HF processor's misses), images_encoded, encoder_embeds,
  steps, prefill_steps, scheduled_tokens, prefill_tokens (scheduled in chunks of more than one
  token), prompt_tokens, cached_prompt_tokens (served by the prefix cache), preempted
"""

from __future__ import annotations

import logging
import time

from rollout.telemetry import gc_clock_off, gc_clock_on, gc_seconds

log = logging.getLogger(__name__)

COUNTS = ("images_sent", "images_processed", "images_encoded", "encoder_embeds", "steps", "prefill_steps",
          "scheduled_tokens", "prefill_tokens", "preempted")
TIMES = ("prep_s", "add_s", "steps_s", "core_s", "outputs_s", "encoder_s", "gc_s")
# what the scheduler's outputs give: null together when the scheduler cannot be wrapped or read
STEP_COUNTS = ("steps", "images_encoded", "encoder_embeds", "prefill_steps", "scheduled_tokens", "prefill_tokens",
               "preempted")

# perf/<metric> summed over a step's generate calls -> the breakdown's key (`breakdown_metrics`)
SUMMED_METRICS = {"gen_prep_s": "prep_s", "gen_add_s": "add_s", "gen_steps_s": "steps_s", "gen_gc_s": "gc_s",
                  "gen_core_s": "core_s", "gen_outputs_s": "outputs_s",
                  "gen_steps": "steps", "gen_prefill_steps": "prefill_steps", "gen_preempted": "preempted",
                  "gen_images_processed": "images_processed",
                  # continuous turns (VLLMEngine.generate_continuing): finished turns handled between steps, polls
                  # for tool results while requests run, and the wait on tools when none runs
                  "gen_follow_s": "follow_s", "gen_poll_s": "poll_s", "gen_tool_wait_s": "tool_wait_s"}
# every perf/<metric> breakdown_metrics may write
METRICS = (*SUMMED_METRICS, "gen_mm_processor_s", "gen_slowest_step_s")


def _wrap(obj, name: str, around) -> bool:
    """Replace obj.name by around(original) on the instance; False where obj lacks it."""
    original = getattr(obj, name, None) if obj is not None else None
    if original is None:
        return False
    setattr(obj, name, around(original))
    return True


class GenerationProbe:
    """Where one generate call's time goes (module docstring), from wrappers on one VLLMEngine's vLLM
    objects. `begin()` before a call, `report()` after it; `synced` synchronizes the GPU around each
    vision encoder call (the benchmark's choice; never in training runs)."""

    def __init__(self, engine, synced: bool = False):
        self.synced = synced
        self.reset()
        self.missing: set[str] = set()
        self.failed: set[str] = set()  # parts whose counting raised: null from then on
        self._gc_at = None  # the collector's clock at begin(): its seconds until report() are the call's
        llm = getattr(engine, "_llm", None)
        core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
        self._scheduler = getattr(core, "scheduler", None)
        self._install(engine, llm, core)
        gc_clock_on()
        self._clock_on = True

    # --- wrappers ------------------------------------------------------------------------------
    def _timer(self, key: str, synced: bool = False):
        """A wrapper adding each call's seconds to times[key]; `synced` waits for the GPU around the call so
        its asynchronous kernels count too."""
        def around(original):
            def timed(*args, **kwargs):
                if synced:
                    import torch

                    torch.cuda.synchronize()
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    if synced:
                        torch.cuda.synchronize()
                    self.times[key] += time.perf_counter() - start
            return timed
        return around

    def _install(self, engine, llm, core) -> None:
        def prep(original):
            timed = self._timer("prep_s")(original)

            def counted(index, prompt):
                self.counts["images_sent"] += len(getattr(prompt, "images", None) or ())
                return timed(index, prompt)
            return counted

        ok = {"prep_s": _wrap(engine, "_vllm_prompt", prep),
              "add_s": _wrap(llm, "_add_completion_requests", self._timer("add_s")),
              "steps_s": _wrap(llm, "_run_engine", self._timer("steps_s"))}
        llm_engine = getattr(llm, "llm_engine", None)
        ok["core_s"] = _wrap(getattr(llm_engine, "engine_core", None), "get_output", self._timer("core_s"))
        ok["outputs_s"] = _wrap(getattr(llm_engine, "output_processor", None), "process_outputs",
                                self._timer("outputs_s"))
        renderer = getattr(getattr(llm, "llm_engine", None), "renderer", None)
        processor = getattr(renderer, "mm_processor", None)
        stage_timing = self._stage_timing_wrapper()
        ok["mm_stage_s"] = stage_timing is not None and _wrap(processor, "apply", stage_timing)
        ok["images_processed"] = _wrap(processor, "_get_cache_missing_items", self._count_missing)
        ok["steps"] = _wrap(self._scheduler, "schedule", self._scheduled)
        runner = getattr(getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None),
                                 "worker", None), "model_runner", None)
        encoder = getattr(getattr(runner, "model_state", None), "encoder_runner", None)  # V2 model runner
        timer = self._timer("encoder_s", synced=self.synced)
        ok["encoder_s"] = (_wrap(encoder, "execute_mm_encoder", timer)
                           or _wrap(runner, "_execute_mm_encoder", timer))  # V1
        self.missing = {k for k, v in ok.items() if not v}
        if "prep_s" in self.missing:
            self.missing.add("images_sent")
        if "steps" in self.missing:
            self.missing |= set(STEP_COUNTS)

    def _failure(self, parts, error: Exception) -> None:
        """A counting wrapper raised: its parts read null from now on; the call it wrapped goes on."""
        if not set(parts) <= self.failed:
            log.warning("GenerationProbe: counting %s failed (%s: %s); they read null from now on",
                        "/".join(parts), type(error).__name__, error)
        self.failed |= set(parts)

    def _stage_timing_wrapper(self):
        """The wrapper of the multimodal processor's `apply` that times its stages with vLLM's own
        TimingContext, or None where vLLM has none."""
        try:
            from vllm.multimodal.processing.context import TimingContext
        except Exception:  # no vLLM, or one without the per-stage timer
            return None

        def around(original):
            def apply(inputs, timing_ctx=None, *args, **kwargs):
                ctx = TimingContext(enabled=True)  # vLLM's own per-stage timer, on for this call
                try:
                    return original(inputs, ctx, *args, **kwargs)
                finally:
                    for stage, secs in ctx.stage_secs.items():
                        self.stages[stage] = self.stages.get(stage, 0.0) + secs
                    if getattr(timing_ctx, "enabled", False):  # vLLM's own stats asked for them too
                        for stage, secs in ctx.stage_secs.items():
                            timing_ctx.stage_secs[stage] = timing_ctx.stage_secs.get(stage, 0.0) + secs
            return apply
        return around

    def _count_missing(self, original):
        def missing(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                is_cached = out[0]
                self.counts["images_processed"] += sum(not c for flags in is_cached.values() for c in flags)
            except Exception as e:
                self._failure(("images_processed",), e)
            return out
        return missing

    def _scheduled(self, original):
        def schedule(*args, **kwargs):
            now = time.perf_counter()
            if self._last_step is not None:
                self._gaps.append(now - self._last_step)
            self._last_step = now
            out = original(*args, **kwargs)
            try:
                self.record_step(out)
            except Exception as e:
                self._failure(STEP_COUNTS, e)
            return out
        return schedule

    def record_step(self, out) -> None:
        """Count one SchedulerOutput: a step, its tokens, its prefill chunks and encoder inputs."""
        per_request = getattr(out, "num_scheduled_tokens", {}) or {}
        if not per_request:
            return
        self.counts["steps"] += 1
        self.counts["scheduled_tokens"] += int(out.total_num_scheduled_tokens)
        chunks = [n for n in per_request.values() if n > 1]
        self.counts["prefill_steps"] += bool(chunks)
        self.counts["prefill_tokens"] += sum(chunks)
        self.counts["preempted"] += len(getattr(out, "preempted_req_ids", None) or ())
        stats = getattr(out, "scheduled_encoder_input_stats", None)
        if stats is not None:
            self.counts["images_encoded"] += stats.num_inputs
            self.counts["encoder_embeds"] += stats.output_tokens
        else:
            for req_id, inputs in (getattr(out, "scheduled_encoder_inputs", None) or {}).items():
                self.counts["images_encoded"] += len(inputs)
                request = self._scheduler.requests.get(req_id) if self._scheduler is not None else None
                if request is not None:
                    self.counts["encoder_embeds"] += sum(request.mm_features[i].mm_position.get_num_embeds()
                                                         for i in inputs)

    # --- reading ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero the counts, times and step intervals for the next call."""
        self.counts = dict.fromkeys(COUNTS, 0)
        self.times = dict.fromkeys(TIMES, 0.0)
        self.stages = {}
        self._gaps = []
        self._last_step = None

    def begin(self) -> None:
        """Start one call: zeroed counts, and garbage collection counted until `report`."""
        self.reset()
        self._gc_at = gc_seconds()

    def report(self, stats: dict | None = None, input_s: float | None = None) -> dict:
        """This call's breakdown (module docstring), then reset; `stats` is the engine's last_stats,
        `input_s` the seconds of building the engine's inputs (the benchmark's; null otherwise)."""
        if self._gc_at is not None:
            self.times["gc_s"] = gc_seconds() - self._gc_at
            self._gc_at = None
        null = self.missing | self.failed
        out = {"input_s": None if input_s is None else round(input_s, 3)}
        for key, value in self.times.items():
            out[key] = None if key in null else round(value, 3)
        out["encoder_synced"] = self.synced
        out["mm_stage_s"] = None if "mm_stage_s" in null else {
            k.removesuffix("_secs"): round(v, 3) for k, v in sorted(self.stages.items())}
        for key, value in self.counts.items():
            out[key] = None if key in null else value
        out["slowest_steps_s"] = None if "steps" in null else [
            round(g, 3) for g in sorted(self._gaps, reverse=True)[:3]]
        stats = stats or {}
        out["prompt_tokens"] = stats.get("prompt_tokens")
        out["cached_prompt_tokens"] = stats.get("cached_prompt_tokens")
        self.reset()
        return out

    def close(self) -> None:
        if self._clock_on:
            gc_clock_off()
            self._clock_on = False


def breakdown_metrics(breakdowns) -> dict[str, float]:
    """perf/gen_* metrics of one breakdown or of a step's several (a multi-turn step calls generate once per
    turn): each SUMMED_METRICS part summed over the calls, `perf/gen_mm_processor_s` the multimodal
    processor's seconds (its stages summed), `perf/gen_slowest_step_s` the longest step of any call. A
    part every call reports null is left out."""
    if isinstance(breakdowns, dict):
        breakdowns = [breakdowns]
    calls = [b for b in breakdowns or () if b]
    out = {}
    for metric, key in SUMMED_METRICS.items():
        values = [b[key] for b in calls if b.get(key) is not None]
        if values:
            out[f"perf/{metric}"] = float(sum(values))
    stages = [sum(b["mm_stage_s"].values()) for b in calls if b.get("mm_stage_s") is not None]
    if stages:
        out["perf/gen_mm_processor_s"] = float(sum(stages))
    slowest = [max(b["slowest_steps_s"]) for b in calls if b.get("slowest_steps_s")]
    if slowest:
        out["perf/gen_slowest_step_s"] = float(max(slowest))
    elif any(b.get("slowest_steps_s") is not None for b in calls):
        out["perf/gen_slowest_step_s"] = 0.0  # steps were watched, but no call took two
    return out
