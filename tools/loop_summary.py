"""Steady-state numbers of a GRPO run from its metrics.jsonl (steps 3 onward by default).

    python tools/loop_summary.py runs/X/metrics.jsonl [--from-step 3] [--config runs/X/config.yaml]
        [--standalone bench.json]

Prints one JSON object: `loop_step_s` (mean step seconds), the mean of each perf/* phase,
`mfu_llm`, `overhead_frac` (the share of a step that is not generation, the policy's passes or
refit), `non_gen_train_frac` (neither generation nor the update: what tools/bench.py calls overhead),
`sleep_wake_s`, `gen_tokens_per_s`, `untimed_frac` (what the phases do not cover), the first
step's seconds and how much longer than a steady step it took, and the peak memory. Where the run
logged its start-up (the trainer does, with the step that built the engine) it adds the seconds of
building the policy, the reference and the data, of the trainer's whole start-up (`init_s`), of the
engine's build (`engine_build_s`: importing vLLM, `LLM(...)`, and vLLM's kernel warm-up inside it), and
`first_step_extra_other_s`: the first step's extra time that the engine's build does not explain, of
which `first_gen_extra_s` in generation (`first_update_extra_s`: the first reference pass and update
beyond steady ones, always reported). Where the steps logged where generation's time went (vLLM under
`rollout.gen_breakdown`, rollout/gen_probe.py) it adds the mean of each of those parts over the steps that
logged it (`gen_prep_s`, `gen_add_s`, `gen_mm_processor_s`, `gen_steps_s` with its `gen_core_s` and
`gen_outputs_s`, `gen_gc_s`,
`gen_slowest_step_s`, `gen_steps`, `gen_prefill_steps`, `gen_preempted`, `gen_images_processed`; with
continuous turns `gen_follow_s`, `gen_poll_s`, `gen_tool_wait_s`), and
`gen_slowest_step_s_max`, the longest step of any of them. Where the steps logged the parts of generation
outside the engine (every engine: rollout/rollouts.py `Rollouts.times`) it adds their means, `gen_data_s`
(the data feed: reading rows, decoding images, the processor) and `gen_score_s` (scoring), and
`gen_engine_tokens_per_s`, the mean over those steps of the step's generation tokens over gen_s less both and
less the engine's wake, sleep and offload (`wake_s`, `sleep_s`, `offload_s`, timed inside gen_s). Where the
steps logged the allocator per pass (on a GPU: rollout/colocation.py `DevicePeak`) it adds the mean of each
over the steps that logged it: `alloc_retries_logprob` and `alloc_retries_update` (retries per step in the
reference/old-logprob pass and in the update), `reserved_growth_gb_*` and `allocated_growth_gb_*` (how far
torch's reserved and allocated bytes grew in the pass), `device_allocs_*` and `device_frees_*` (the driver
allocations and frees the pass made), `inactive_split_gb_*` (the most bytes held in free pieces of segments
with live blocks) and `inactive_split_gb_generation` (those left when the engine wakes).
Where the steps logged GPU telemetry (`trainer.gpu_telemetry`, rollout/telemetry.py) it adds, per phase (`gen`,
`logprob`, `score`, `train`, `refit`), the mean over the steps that logged each of `sm_clock_mhz_mean_<phase>`,
`sm_clock_mhz_min_<phase>`, `power_w_mean_<phase>`, `temp_c_max_<phase>`, `throttled_frac_<phase>`,
`power_capped_frac_<phase>`, `thermal_frac_<phase>`, `util_pct_mean_<phase>`, `mem_util_pct_mean_<phase>`
and `samples_<phase>`, the host's `process_cores_<phase>`,
`other_cores_<phase>` and `main_thread_cores_<phase>` (this process's CPU, other processes' and the trainer
thread's per second of the phase), `gc_s_<phase>` and `gc_full_<phase>` (the garbage collector's seconds and full
collections in the phase, per step), and the device's
`sm_clock_max_mhz` and `power_limit_w` (from the first step, which logs them). With
`--config` (the run's resolved config.yaml) it adds the settings that tell measured variants apart:
`sleep_level`, `compile`, `liger_kernel`, `liger_mlp`, `fp32_logits`, `vision_once`, `pad_vision_mlp`, `torch_rms_norm`,
`flash_direct`, `lora_rank`, `lora_alpha`, `activation_checkpointing`, `prompts_per_step`, `n` and `max_new_tokens`.
`liger_kernel`, `pad_vision_mlp`, `torch_rms_norm` and `flash_direct` are what ran, true or false: the trainer
writes them settled (`auto` resolved for the family and device) as the words true/false, which read back as
booleans, like the booleans that runs before `auto` wrote. With `--standalone` (the JSON of
`tools/bench.py --phases engine`: a standalone vLLM on the loop's requests) it adds
`standalone_gen_tokens_per_s` and `loop_gen_vs_standalone`, the loop's generation tokens/s over it, and
(with `gen_engine_tokens_per_s`) `loop_engine_vs_standalone`, the loop's tokens/s without the data feed,
scoring, wake and sleep over it: the standalone times `llm.generate` alone. Where that JSON also has
`standalone_inproc_gen_tokens_per_s` (`--standalone-inproc`: vLLM's engine core in the calling process, as in the
trainer) it adds the same two ratios against it, `loop_gen_vs_standalone_inproc` and
`loop_engine_vs_standalone_inproc`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

# summary key -> the config keys that hold it, outermost first
SETTINGS = {
    "sleep_level": ("rollout", "sleep_level"), "compile": ("model", "compile"),
    "liger_kernel": ("model", "liger_kernel"), "lora_rank": ("model", "lora", "rank"),
    "lora_alpha": ("model", "lora", "alpha"), "activation_checkpointing": ("model", "activation_checkpointing"),
    "prompts_per_step": ("data", "prompts_per_step"), "n": ("rollout", "n"),
    "max_new_tokens": ("rollout", "max_new_tokens"),
    "unsharded_accumulation": ("optim", "unsharded_accumulation"),
    "allocate_state_at_start": ("optim", "allocate_state_at_start"),
    "max_tokens_per_microbatch": ("optim", "max_tokens_per_microbatch"), "prefetch": ("data", "prefetch"),
    "shared_prompts": ("model", "shared_prompts"), "fp32_logits": ("model", "fp32_logits"),
    "vision_once": ("model", "vision_once"), "pad_vision_mlp": ("model", "pad_vision_mlp"),
    "torch_rms_norm": ("model", "torch_rms_norm"), "flash_direct": ("model", "flash_direct"),
    "liger_mlp": ("model", "liger_mlp"), "one_device": ("parallel", "one_device"),
    "gc_freeze": ("trainer", "gc_freeze"),
    "engine_warmup": ("rollout", "engine_warmup"), "engine_startup_plan": ("rollout", "engine_startup_plan"),
    "gen_breakdown": ("rollout", "gen_breakdown"), "profile_step": ("trainer", "profile_step"),
}
# settings config.yaml holds as the words true/false (an auto key the trainer settled: grpo.config.SETTLED_BY_POLICY):
# read as booleans
WORD_BOOLEANS = ("liger_kernel", "pad_vision_mlp", "torch_rms_norm", "flash_direct")
# start-up seconds the trainer logs once, as perf/<name>
STARTUP = ("policy_build_s", "reference_build_s", "data_build_s", "init_s", "engine_build_s", "engine_import_s",
           "engine_llm_s", "engine_warmup_s")
# where generation's time went, per step as perf/<name> (rollout/gen_probe.py METRICS): means over the steps
# that logged each
GEN_BREAKDOWN = ("gen_prep_s", "gen_add_s", "gen_mm_processor_s", "gen_steps_s", "gen_core_s", "gen_outputs_s",
                 "gen_gc_s", "gen_slowest_step_s",
                 "gen_steps", "gen_prefill_steps", "gen_preempted", "gen_images_processed", "gen_follow_s", "gen_poll_s",
                 "gen_tool_wait_s")
# the parts of generation outside the engine, per step as perf/<name> (rollout/rollouts.py TIMES, every engine):
# means over the steps that logged each
GEN_OUTSIDE = ("gen_data_s", "gen_score_s")
# the allocator per pass, per step as memory/<name> (rollout/colocation.py DevicePeak, GPU only): means over the
# steps that logged each
MEMORY_PHASES = tuple(f"{m}_{p}" for p in ("logprob", "update") for m in (
    "alloc_retries", "reserved_growth_gb", "allocated_growth_gb", "inactive_split_gb", "device_allocs", "device_frees")) + (
    "inactive_split_gb_generation", "alloc_retries_generation", "device_allocs_generation", "device_frees_generation")
# GPU telemetry per phase, per step as gpu/<name> (rollout/telemetry.py, where NVML answers): means over the steps
# that logged each; GPU_ONCE from the first row that logged it
TELEMETRY_PHASES = ("gen", "logprob", "score", "train", "refit")  # grpo/trainer.py STEP_PHASES' names
GPU_PHASES = tuple(f"{m}_{p}" for p in TELEMETRY_PHASES for m in (
    "sm_clock_mhz_mean", "sm_clock_mhz_min", "power_w_mean", "temp_c_max", "throttled_frac", "power_capped_frac",
    "thermal_frac", "util_pct_mean", "mem_util_pct_mean", "samples"))
GPU_ONCE = ("sm_clock_max_mhz", "power_limit_w")
# the host's cores per phase, per step as host/<name> (rollout/telemetry.py, with the GPU telemetry)
HOST_PHASES = tuple(f"{m}_{p}" for p in TELEMETRY_PHASES for m in ("process_cores", "other_cores",
                                                                    "main_thread_cores", "gc_s", "gc_full"))


def read_rows(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as e:
        raise SystemExit(f"{path}: cannot read the metrics ({type(e).__name__}: {e})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}:{n}: skipped a line that is not JSON", file=sys.stderr)
    return rows


def summarize(rows: list[dict], from_step: int = 3, skip: int = 0) -> dict:
    """The steady steps' means (steps from `from_step` on, less `skip`: a step run under the profiler)."""
    steady = [r for r in rows if r.get("step", 0) >= from_step and r.get("step") != skip]
    if not steady:
        raise SystemExit(f"no steps >= {from_step} in the metrics ({len(rows)} rows)")
    mean = lambda k: statistics.mean(r.get(k, 0.0) for r in steady)  # noqa: E731
    step = mean("perf/step_s")
    out = {"steps": [r["step"] for r in steady], "loop_step_s": step,
           "loop_step_s_min": min(r["perf/step_s"] for r in steady),
           "loop_step_s_max": max(r["perf/step_s"] for r in steady)}
    for k in ("gen_s", "logprob_s", "score_s", "train_s", "refit_s", "wake_s", "sleep_s", "offload_s", "other_s",
              "refit_cache_s", "refit_gather_s", "refit_engine_s", "logprob_pack_s"):
        out[k] = mean(f"perf/{k}")
    out.update(
        mfu_llm=mean("perf/mfu_llm"), gen_tokens_per_s=mean("perf/gen_tokens_per_s"),
        train_tokens_per_s=mean("perf/tokens_per_s"), sleep_wake_s=out["wake_s"] + out["sleep_s"],
        row_token_share=mean("perf/row_token_share"),
        # everything but generation, the policy's passes (reference/old logprobs and the update) and refit
        overhead_frac=(step - out["gen_s"] - out["logprob_s"] - out["train_s"] - out["refit_s"]) / step,
        non_gen_train_frac=(step - out["gen_s"] - out["train_s"]) / step, untimed_frac=out["other_s"] / step,
        token_mult_prob_error=mean("fidelity/token_mult_prob_error"),
        peak_gb=max(r.get("memory/peak_gb", 0.0) for r in rows),
        alloc_retries=sum(r.get("memory/alloc_retries", 0.0) for r in rows),
    )
    out.update(gen_breakdown(steady))
    out.update(logged_means(steady, "memory", MEMORY_PHASES))
    out.update(logged_means(steady, "gpu", GPU_PHASES))
    out.update(logged_means(steady, "host", HOST_PHASES))
    first = next((r for r in rows if r.get("step") == 1), None)
    if first:
        out["first_step_s"] = first["perf/step_s"]
        out["first_step_extra_s"] = first["perf/step_s"] - step
        out["first_sleep_s"] = first.get("perf/sleep_s", 0.0)
        # the first reference/old-logprob pass and update against steady ones (allocator, kernels, NCCL warming up)
        out["first_update_extra_s"] = (first.get("perf/logprob_s", 0.0) + first.get("perf/train_s", 0.0)
                                       - out["logprob_s"] - out["train_s"])
    out.update(startup(rows))
    out.update(first_logged(rows, "gpu", GPU_ONCE))
    if first and "engine_build_s" in out:
        out["first_step_extra_other_s"] = out["first_step_extra_s"] - out["engine_build_s"]
        # generation beyond a steady one once the engine is built: kernels the warm-up left to compile
        out["first_gen_extra_s"] = first.get("perf/gen_s", 0.0) - out["engine_build_s"] - out["gen_s"]
    return out


def logged_means(steady: list[dict], prefix: str, names) -> dict:
    """{name: mean of `prefix/name` over the steps that logged it} (a name no step logged is left out)."""
    out = {}
    for name in names:
        values = [r[f"{prefix}/{name}"] for r in steady if r.get(f"{prefix}/{name}") is not None]
        if values:
            out[name] = statistics.mean(values)
    return out


def gen_breakdown(steady: list[dict]) -> dict:
    """GEN_BREAKDOWN and GEN_OUTSIDE means over the steps that logged each (none: left out),
    gen_slowest_step_s_max, and gen_engine_tokens_per_s (`engine_tokens_per_s`)."""
    out = logged_means(steady, "perf", GEN_BREAKDOWN + GEN_OUTSIDE)
    slowest = [r["perf/gen_slowest_step_s"] for r in steady if r.get("perf/gen_slowest_step_s") is not None]
    if slowest:
        out["gen_slowest_step_s_max"] = max(slowest)
    rates = [rate for rate in map(engine_tokens_per_s, steady) if rate is not None]
    if rates:
        out["gen_engine_tokens_per_s"] = statistics.mean(rates)
    return out


# the engine's sleep, wake and offload, timed inside gen_s (the colocation's, where logged): not generation
GEN_COLOCATION = ("wake_s", "sleep_s", "offload_s")


def engine_tokens_per_s(row: dict) -> float | None:
    """A step's generation tokens over its gen_s less the data feed and scoring (GEN_OUTSIDE) and the
    engine's wake, sleep and offload (GEN_COLOCATION, those logged); None where the step lacks any of
    GEN_OUTSIDE or they leave no seconds."""
    keys = ("perf/gen_tokens_per_s", "perf/gen_s", *(f"perf/{name}" for name in GEN_OUTSIDE))
    if any(row.get(k) is None for k in keys):
        return None
    engine_s = (row["perf/gen_s"] - sum(row[f"perf/{name}"] for name in GEN_OUTSIDE)
                - sum(row.get(f"perf/{name}") or 0.0 for name in GEN_COLOCATION))
    if engine_s <= 0:
        return None
    return row["perf/gen_tokens_per_s"] * row["perf/gen_s"] / engine_s


def startup(rows: list[dict]) -> dict:
    """The STARTUP seconds, each from the first row that logged it; those no row holds are left out."""
    return first_logged(rows, "perf", STARTUP)


def first_logged(rows: list[dict], prefix: str, names) -> dict:
    """{name: `prefix/name` of the first row that logged it} (a name no row holds is left out)."""
    out = {}
    for name in names:
        key = f"{prefix}/{name}"
        value = next((r[key] for r in rows if key in r), None)
        if value is not None:
            out[name] = value
    return out


def read_settings(path: Path) -> dict:
    """The SETTINGS of a run's resolved config.yaml; a key the file lacks is left out."""
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"{path}: cannot read the run's config ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise SystemExit(f"{path}: not a config (a YAML mapping), got {type(cfg).__name__}")
    out = {}
    for name, keys in SETTINGS.items():
        value = cfg
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        if name in WORD_BOOLEANS and value in ("true", "false"):
            value = value == "true"
        if value is not None:
            out[name] = value
    return out


def read_standalone(path: Path, loop: dict) -> dict:
    """The standalone vLLM's tokens/s from a tools/bench.py JSON, and the loop's generation against it."""
    try:
        bench = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read the standalone run ({type(e).__name__}: {e})") from None
    rate = bench.get("standalone_gen_tokens_per_s") if isinstance(bench, dict) else None
    if not rate:
        raise SystemExit(f"{path}: no standalone_gen_tokens_per_s (run tools/bench.py with --phases engine)")
    out = {"standalone_gen_tokens_per_s": rate, "loop_gen_vs_standalone": loop["gen_tokens_per_s"] / rate}
    if "gen_engine_tokens_per_s" in loop:  # the loop's generation without its data feed and scoring
        out["loop_engine_vs_standalone"] = loop["gen_engine_tokens_per_s"] / rate
    inproc = bench.get("standalone_inproc_gen_tokens_per_s")
    if inproc:  # tools/bench.py --standalone-inproc: the engine core in-process, as in the trainer
        out["standalone_inproc_gen_tokens_per_s"] = inproc
        out["loop_gen_vs_standalone_inproc"] = loop["gen_tokens_per_s"] / inproc
        if "gen_engine_tokens_per_s" in loop:
            out["loop_engine_vs_standalone_inproc"] = loop["gen_engine_tokens_per_s"] / inproc
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", type=Path)
    p.add_argument("--from-step", type=int, default=3)
    p.add_argument("--config", type=Path, default=None, help="the run's config.yaml: add its settings")
    p.add_argument("--standalone", type=Path, default=None,
                   help="tools/bench.py's JSON with standalone_gen_tokens_per_s: add loop_gen_vs_standalone "
                        "(and loop_engine_vs_standalone)")
    args = p.parse_args(argv)
    settings = read_settings(args.config) if args.config is not None else {}
    # trainer.profile_step: that step ran under torch.profiler, slower, so it is no steady step
    out = summarize(read_rows(args.metrics), args.from_step, int(settings.get("profile_step") or 0))
    out.update(settings)
    if args.standalone is not None:
        out.update(read_standalone(args.standalone, out))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
