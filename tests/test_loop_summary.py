"""tools/loop_summary.py: steady-state means of a run's metrics, and the settings of its config.yaml."""

import json

import pytest

from grpo.config import load_config, save_config
from tools.loop_summary import main, read_rows, read_settings, summarize


def _row(step: int, step_s: float) -> dict:
    return {"step": step, "perf/step_s": step_s, "perf/gen_s": 2.0, "perf/logprob_s": 1.5, "perf/train_s": 5.0,
            "perf/refit_s": 0.5, "perf/sleep_s": 0.2, "perf/wake_s": 0.01, "perf/mfu_llm": 0.28,
            "perf/gen_tokens_per_s": 1.8e4,
            "fidelity/token_mult_prob_error": 1.03, "memory/peak_gb": 90.0 + step}


def _write(tmp_path, overrides):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(_row(s, t)) for s, t in [(1, 50.0), (2, 12.0), (3, 9.0), (4, 10.0),
                                                                     (5, 11.0)]) + "\n")
    cfg = load_config("configs/clevr_qwen2_5_vl_3b.yaml", ["model.path=/m", "data.train_path=/d.parquet",
                                                           *overrides])
    save_config(cfg, tmp_path / "config.yaml")
    return metrics, tmp_path / "config.yaml"


def test_summary_takes_steady_steps_and_the_run_settings(tmp_path, capsys):
    metrics, config = _write(tmp_path, ["rollout.sleep_level=2", "model.lora.rank=16", "model.lora.alpha=32",
                                        "model.compile=true", "optim.allocate_state_at_start=true"])
    s = summarize(read_rows(metrics))
    assert s["steps"] == [3, 4, 5] and s["loop_step_s"] == pytest.approx(10.0)
    assert s["first_step_extra_s"] == pytest.approx(40.0) and s["peak_gb"] == 95.0
    main([str(metrics), "--config", str(config)])
    out = json.loads(capsys.readouterr().out)
    assert (out["sleep_level"], out["compile"], out["lora_rank"], out["lora_alpha"]) == (2, True, 16, 32.0)
    assert (out["max_new_tokens"], out["n"], out["liger_kernel"]) == (512, 8, False)
    assert (out["allocate_state_at_start"], out["max_tokens_per_microbatch"], out["prefetch"]) == (True, 8192, False)
    assert out["loop_step_s"] == pytest.approx(10.0)


def test_the_profiled_step_is_no_steady_step(tmp_path, capsys):
    metrics, config = _write(tmp_path, ["trainer.profile_step=5"])
    main([str(metrics), "--config", str(config)])
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == [3, 4] and out["loop_step_s"] == pytest.approx(9.5) and out["profile_step"] == 5


def test_summary_sets_the_loop_generation_against_a_standalone_run(tmp_path, capsys):
    metrics, config = _write(tmp_path, [])
    loop = summarize(read_rows(metrics))["gen_tokens_per_s"]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"standalone_gen_tokens_per_s": loop * 1.25, "gen_tokens_per_s": 1.0}))
    main([str(metrics), "--standalone", str(bench)])
    out = json.loads(capsys.readouterr().out)
    assert out["loop_gen_vs_standalone"] == pytest.approx(0.8) and out["standalone_gen_tokens_per_s"] > loop
    assert not [k for k in out if "inproc" in k]
    # tools/bench.py --standalone-inproc: the engine core in-process too
    bench.write_text(json.dumps({"standalone_gen_tokens_per_s": loop * 1.25,
                                 "standalone_inproc_gen_tokens_per_s": loop * 1.1}))
    main([str(metrics), "--standalone", str(bench)])
    out = json.loads(capsys.readouterr().out)
    assert out["loop_gen_vs_standalone_inproc"] == pytest.approx(1 / 1.1)
    assert out["loop_gen_vs_standalone"] == pytest.approx(0.8)
    bench.write_text(json.dumps({"gen_tokens_per_s": 1.0}))
    with pytest.raises(SystemExit, match="no standalone_gen_tokens_per_s"):
        main([str(metrics), "--standalone", str(bench)])


def test_bad_paths_name_the_file(tmp_path):
    with pytest.raises(SystemExit, match="missing.jsonl: cannot read the metrics"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit, match="missing.yaml: cannot read the run's config"):
        read_settings(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SystemExit, match="list.yaml: not a config"):
        read_settings(tmp_path / "list.yaml")


def test_summary_reports_the_start_up_and_what_the_engine_build_leaves(tmp_path):
    rows = [_row(s, t) for s, t in [(1, 50.0), (2, 12.0), (3, 9.0), (4, 10.0), (5, 11.0)]]
    rows[0].update({"perf/policy_build_s": 7.5, "perf/reference_build_s": 3.0, "perf/data_build_s": 0.5,
                    "perf/init_s": 12.0, "perf/engine_build_s": 28.0, "perf/engine_import_s": 5.0,
                    "perf/engine_llm_s": 23.0, "perf/engine_warmup_s": 13.0, "perf/gen_s": 33.0})
    s = summarize(rows)
    assert (s["policy_build_s"], s["reference_build_s"], s["data_build_s"], s["init_s"]) == (7.5, 3.0, 0.5, 12.0)
    assert (s["engine_build_s"], s["engine_import_s"], s["engine_llm_s"], s["engine_warmup_s"]) == (28, 5, 23, 13)
    assert s["first_step_extra_other_s"] == pytest.approx(40.0 - 28.0)
    assert s["first_gen_extra_s"] == pytest.approx(33.0 - 28.0 - 2.0)  # steady generation: 2.0
    assert s["first_update_extra_s"] == pytest.approx(0.0)
    # a run from before the start-up timings: none of the keys, the rest as before
    old = summarize([_row(s, t) for s, t in [(1, 50.0), (3, 9.0)]])
    assert "engine_build_s" not in old and "first_step_extra_other_s" not in old and old["first_step_extra_s"] == 41


def test_summary_names_the_engine_start_up_settings(tmp_path):
    metrics, config = _write(tmp_path, ["rollout.engine_warmup=lean", "rollout.engine_startup_plan=true"])
    assert read_settings(config)["engine_warmup"] == "lean" and read_settings(config)["engine_startup_plan"] is True


def test_summary_averages_where_generation_s_time_went(tmp_path):
    """perf/gen_* of rollout.gen_breakdown: means over the steady steps that logged each, and the longest step."""
    from rollout.gen_probe import METRICS
    from tools.loop_summary import GEN_BREAKDOWN

    assert set(GEN_BREAKDOWN) == set(METRICS)  # every metric the trainer may log
    rows = [_row(s, t) for s, t in [(1, 50.0), (2, 12.0), (3, 9.0), (4, 10.0), (5, 11.0)]]
    for r, slowest in zip(rows, (3.0, 0.5, 0.2, 0.4, 0.3)):
        r.update({"perf/gen_steps_s": r["step"] * 0.5, "perf/gen_slowest_step_s": slowest, "perf/gen_steps": 300.0,
                  "perf/gen_add_s": 0.25})
    del rows[3]["perf/gen_add_s"]  # a step that logged no such part
    s = summarize(rows)
    assert s["gen_steps_s"] == pytest.approx(2.0) and s["gen_steps"] == 300.0 and s["gen_add_s"] == 0.25
    assert s["gen_slowest_step_s"] == pytest.approx(0.3) and s["gen_slowest_step_s_max"] == 0.4
    assert "gen_mm_processor_s" not in s and "gen_prep_s" not in s
    assert not any(k.startswith("gen_") and k != "gen_s" and k != "gen_tokens_per_s"
                   for k in summarize([_row(3, 9.0)]))  # a run without them: none
    metrics, config = _write(tmp_path, ["rollout.gen_breakdown=false"])
    assert read_settings(config)["gen_breakdown"] is False


def test_summary_sets_generation_without_its_data_feed_and_scoring_against_a_standalone_run(tmp_path, capsys):
    """perf/gen_data_s and perf/gen_score_s: means over the steady steps that logged them, and the loop's
    tokens over gen_s less both against the standalone's tokens/s (loop_gen_vs_standalone as before)."""
    from rollout.rollouts import TIMES
    from tools.loop_summary import GEN_OUTSIDE

    assert set(GEN_OUTSIDE) == {f"gen_{k}" for k in TIMES}  # every part the trainer logs
    rows = [_row(s, t) for s, t in [(1, 50.0), (2, 12.0), (3, 9.0), (4, 10.0), (5, 11.0)]]
    for r, data_s, score_s in zip(rows, (9.0, 9.0, 0.2, 0.4, 0.6), (0.1, 0.1, 0.3, 0.1, 0.2)):
        r.update({"perf/gen_data_s": data_s, "perf/gen_score_s": score_s})
    # each steady step: 1.8e4 tokens/s over gen_s 2.0, so 3.6e4 tokens; engine seconds 1.5, 1.5, 1.2 less the
    # engine's sleep (0.2 s) and wake (0.01 s), also timed inside gen_s
    rates = [3.6e4 / 1.29, 3.6e4 / 1.29, 3.6e4 / 0.99]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = summarize(read_rows(metrics))
    assert s["gen_data_s"] == pytest.approx(0.4) and s["gen_score_s"] == pytest.approx(0.2)
    assert s["gen_engine_tokens_per_s"] == pytest.approx(sum(rates) / 3)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"standalone_gen_tokens_per_s": 2.5e4}))
    main([str(metrics), "--standalone", str(bench)])
    out = json.loads(capsys.readouterr().out)
    assert out["loop_gen_vs_standalone"] == pytest.approx(1.8e4 / 2.5e4)
    assert out["loop_engine_vs_standalone"] == pytest.approx(sum(rates) / 3 / 2.5e4)
    # a run from before them: neither the means nor the engine's share
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(_row(3, 9.0)) + "\n")
    main([str(old), "--standalone", str(bench)])
    out = json.loads(capsys.readouterr().out)
    assert "gen_data_s" not in out and "loop_engine_vs_standalone" not in out and "loop_gen_vs_standalone" in out


def test_summary_averages_the_allocator_per_pass_where_logged(tmp_path):
    rows = [_row(s, 10.0) for s in range(1, 6)]
    for r in rows[2:]:  # steps 3-5, on a GPU
        r.update({"memory/alloc_retries_update": float(r["step"] - 2), "memory/alloc_retries_logprob": 0.0,
                  "memory/inactive_split_gb_update": 4.0, "memory/reserved_growth_gb_update": 30.0,
                  "memory/inactive_split_gb_generation": 20.0 + r["step"],
                  "memory/device_allocs_update": 100.0 * r["step"]})
    rows[0]["memory/alloc_retries_update"] = 9.0  # the first step is not steady
    s = summarize(rows)
    assert s["alloc_retries_update"] == pytest.approx(2.0) and s["alloc_retries_logprob"] == 0.0
    assert s["inactive_split_gb_update"] == 4.0 and s["reserved_growth_gb_update"] == 30.0
    assert s["inactive_split_gb_generation"] == pytest.approx(24.0)
    assert s["device_allocs_update"] == pytest.approx(400.0)
    assert "allocated_growth_gb_update" not in s  # not logged: left out
    cpu = summarize([_row(s, 10.0) for s in range(1, 6)])
    assert not any(k.startswith(("alloc_retries_", "inactive_split", "reserved_growth")) for k in cpu)


def test_summary_averages_the_gpu_telemetry_per_phase_where_logged():
    """gpu/* of trainer.gpu_telemetry: per phase, means over the steady steps that logged each; the device's
    maximum clock and power limit from the step that logged them (the first)."""
    from grpo.trainer import STEP_PHASES
    from tools.loop_summary import GPU_PHASES

    # every phase the trainer times
    assert {k.removeprefix("perf/").removesuffix("_s") for k in STEP_PHASES} == {
        name.rsplit("_", 1)[1] for name in GPU_PHASES}
    rows = [_row(s, 10.0) for s in range(1, 6)]
    rows[0].update({"gpu/sm_clock_max_mhz": 1980.0, "gpu/power_limit_w": 700.0, "gpu/sm_clock_mhz_mean_gen": 900.0})
    for r, clock, throttled in zip(rows[2:], (1500.0, 1700.0, 1900.0), (0.5, 0.25, 0.0)):
        r.update({"gpu/sm_clock_mhz_mean_gen": clock, "gpu/sm_clock_mhz_min_gen": clock - 300,
                  "gpu/throttled_frac_gen": throttled, "gpu/power_w_mean_train": 690.0})
    del rows[4]["gpu/power_w_mean_train"]  # a phase without a reading that step
    for r, other in zip(rows[2:], (0.5, 1.5, 2.5)):
        r.update({"host/process_cores_gen": 1.0, "host/other_cores_gen": other})
    s = summarize(rows)
    assert s["process_cores_gen"] == 1.0 and s["other_cores_gen"] == pytest.approx(1.5)
    assert s["sm_clock_mhz_mean_gen"] == pytest.approx(1700.0) and s["sm_clock_mhz_min_gen"] == pytest.approx(1400.0)
    assert s["throttled_frac_gen"] == pytest.approx(0.25) and s["power_w_mean_train"] == 690.0
    assert (s["sm_clock_max_mhz"], s["power_limit_w"]) == (1980.0, 700.0)
    assert "temp_c_max_gen" not in s  # not logged: left out
    off = summarize([_row(s, 10.0) for s in range(1, 6)])
    assert not any(k.startswith(("sm_clock", "power_", "temp_c", "throttled", "process_cores", "other_cores"))
                   for k in off)
