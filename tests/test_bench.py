"""The benchmark suite: FLOP counting by hand, and a CPU run at tiny size that reports every key."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT
from tools.bench import llm_flops, missed_targets

REQUIRED = ("date", "device", "command", "model", "train_tokens_per_s", "gen_tokens_per_s", "refit_s",
            "sleep_s", "wake_s", "padding_waste", "peak_mem_gb", "grpo_step_s", "grpo_gen_s", "grpo_train_s",
            "overhead_frac", "achieved_tflops_llm", "achieved_tflops_total")


def test_llm_flops_by_hand():
    cfg = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                          num_hidden_layers=3, vocab_size=100)
    # head_dim 4; mlp 3·8·16 = 384; attention projections q 8, k 4, v 4, o 8 wide: 8·24 = 192
    dense = (384 + 8 * (8 + 4 + 4 + 8)) * 3 + 2 * 100 * 8
    tokens = [5, 7]
    expected = 6 * dense * 12 + 12 * (25 + 49) * 4 * 2 * 3
    assert llm_flops(cfg, tokens) == expected


def test_missed_targets_say_by_how_much():
    missed = missed_targets({"mfu_llm": 0.30, "refit_s": 0.2, "overhead_frac": 0.10})
    assert set(missed) == {"mfu_llm", "overhead_frac"}
    assert missed["mfu_llm"]["off_by"] == pytest.approx(1 / 3, abs=1e-3)
    assert missed["overhead_frac"]["target"] == "<= 0.05"


def test_set_overrides_win_over_the_benchmarks_own_keys():
    """`--set KEY=VALUE` (the update and qwen35 stages' variants) lands in the trainer's config after the keys
    bench.py sets itself, so it overrides them: varlen attention over `--attn auto`, liger on."""
    from pathlib import Path

    from tools.bench import _config, _parse

    args = _parse(["--family", "qwen3_5", "--size", "qwen3_5_4b", "--max-tokens", "4096",
                   "--set", "model.attn_implementation=varlen", "--set", "model.liger_kernel=true"])
    cfg = _config(args, Path("model"), Path("data.parquet"))
    assert cfg.model.attn_implementation == "varlen" and cfg.model.liger_kernel == "true"
    assert cfg.optim.max_tokens_per_microbatch == 4096
    assert _config(_parse([]), Path("model"), Path("data.parquet")).model.liger_kernel == "auto"



def test_the_in_process_standalone_runs_a_second_child_with_vllm_s_engine_core_in_process(tmp_path, monkeypatch):
    """--standalone-inproc: a second child with VLLM_ENABLE_V1_MULTIPROCESSING=0, its numbers as standalone_inproc_*;
    without it one child; a child that fails leaves an error, not a crash."""
    from tools import bench

    seen = []

    def run(cmd, env, cwd):
        seen.append(env.get("VLLM_ENABLE_V1_MULTIPROCESSING"))
        out = cmd[cmd.index("--standalone-child") + 1]
        rate = 100.0 if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" else 80.0
        (tmp_path / out).write_text(json.dumps({"standalone_gen_tokens_per_s": rate, "standalone_build_s": 1.0}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    args = SimpleNamespace(workdir=str(tmp_path), standalone_inproc=False)
    assert bench._run_standalone(args) == {"standalone_gen_tokens_per_s": 100.0, "standalone_build_s": 1.0}
    assert seen == [None]
    args.standalone_inproc = True
    out = bench._run_standalone(args)
    assert seen[1:] == [None, "0"]
    assert out["standalone_gen_tokens_per_s"] == 100.0 and out["standalone_inproc_gen_tokens_per_s"] == 80.0
    assert out["standalone_inproc_build_s"] == 1.0
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, env, cwd: SimpleNamespace(returncode=1))
    assert bench._run_standalone(args)["standalone_error"] == "child exited 1"


@pytest.mark.slow
def test_bench_runs_at_tiny_size_on_cpu(tmp_path):
    cmd = [sys.executable, "tools/bench.py", "--size", "tiny", "--engine", "torch", "--image-size", "56",
           "--response-len", "16", "--train-seqs", "8", "--group", "4", "--train-steps", "1", "--gen-prompts", "4",
           "--gen-tokens", "8", "--grpo-steps", "1", "--grpo-prompts", "2", "--grpo-new-tokens", "8",
           "--max-tokens", "512", "--set", "optim.max_tokens_per_microbatch=256", "--set", "model.shared_prompts=off",
           "--empty-cache", "--workdir", str(tmp_path),
           "--profile", str(tmp_path / "prof.txt"), "--phase-clock"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in REQUIRED:
        assert key in result, key
    assert result["train_tokens_per_s"] > 0 and result["gen_tokens"] == 4 * 4 * 8
    # generation: a warm-up call on the very requests, then three timed calls, the median reported
    assert len(result["gen_s_all"]) == 3 and result["gen_s"] == sorted(result["gen_s_all"])[1]
    assert 0 <= result["padding_waste"] < 1 and 0 <= result["overhead_frac"] < 1
    assert result["achieved_tflops_total"] > result["achieved_tflops_llm"] > 0
    assert result["grpo_token_mult_prob_error"] <= 1.0001
    assert result["liger_kernel"] is False  # model.liger_kernel=auto, settled off on CPU
    # the update packs by the --set micro-batch size (256), which comes after --max-tokens (512 would fit one);
    # unshared rows (--set model.shared_prompts=off: auto shares on CPU), so they hold every sequence's tokens
    assert result["shared_prompts"] is False
    assert 256 < result["row_tokens"] <= 512 and result["train_microbatches"] >= 2, result["row_tokens"]
    assert result["empty_cache"] is True and result["device_allocs_per_step"] == 0  # no CUDA cache on CPU
    # the host's cores over the timed update steps, named as the loop's summary names them (NVML's only on CUDA)
    assert 0 < result["main_thread_cores_train"] <= result["process_cores_train"] * 1.01
    assert "util_pct_mean_train" not in result
    profile = (tmp_path / "prof.txt").read_text()
    assert profile.startswith("profiled step:") and "aten::" in profile
    assert "x  backward\n" in profile.split("--- phases")[1]  # the update's phases, each with its host time
    assert 0 < result["profiled_block_s"] and "profiled_idle_s" not in result  # kernels' idle time: CUDA only
    # --phase-clock: one more step's phases without a profiler, each micro-batch's language model and backward
    clock, wall = result["phase_clock"], result["phase_clock_step_s"]
    assert {"pack", "language model", "logprobs", "loss", "backward", "clip and optimizer step"} <= set(clock)
    assert clock["language model"]["count"] == clock["backward"]["count"] == result["train_microbatches"]
    assert all(row["device_s"] is None and row["host_s"] > 0 for row in clock.values())  # no device spans on CPU
    assert clock["language model"]["host_s"] + clock["backward"]["host_s"] < wall
    assert "phases of one step" in proc.stdout and "clip and optimizer step" in proc.stdout


def test_current_table_reads_the_recipe_as_shipped():
    from tools.bench import current_table

    shipped = {"loop_step_s": 11.0, "mfu_llm": 0.25, "command": "loop", "date": "d1", "device": "H200"}
    variant = {"loop_step_s": 7.0, "mfu_llm": 0.40, "command": "loop lora", "date": "d2", "device": "H200",
               "overrides": "model.lora.rank=16"}
    table = current_table([shipped, variant])
    step_line = next(line for line in table.splitlines() if "GRPO step through train.py" in line)
    assert "| 11.00 |" in step_line and "7.00" not in table
    assert "25.0%" in table and "40.0%" not in table
    slow = {"loop_step_s": 14.0, "mfu_llm": 0.12, "command": "loop", "date": "d3", "device": "H200", "current": False}
    table = current_table([shipped, variant, slow])
    assert "| 11.00 |" in table and "14.00" not in table and "12.0%" not in table


def test_current_table_reads_the_first_step_from_a_machine_that_ran_the_recipe():
    from tools.bench import current_table

    warm = {"loop_step_s": 6.0, "first_step_extra_s": 22.0, "command": "loop", "date": "d1", "device": "H200"}
    cold = {"loop_step_s": 5.9, "first_step_extra_s": 65.0, "command": "loop", "date": "d2", "device": "H200",
            "machine_first_run": True}
    lines = current_table([warm, cold]).splitlines()
    first = next(line for line in lines if "first step beyond" in line)
    assert "| 22.0 | yes |" in first and "65.0" not in first
    # the other targets still read the newest row, a machine's first run included
    assert "| 5.90 |" in next(line for line in lines if "GRPO step through train.py" in line)
    # a variant acting from step 2 on counts for the first step only
    late = {"loop_step_s": 5.0, "first_step_extra_s": 20.0, "command": "loop rc", "date": "d3", "device": "H200",
            "overrides": "optim.x=true", "first_step_as_shipped": True}
    lines = current_table([warm, cold, late]).splitlines()
    assert "| 20.0 | yes |" in next(line for line in lines if "first step beyond" in line)
    assert "| 5.90 |" in next(line for line in lines if "GRPO step through train.py" in line)
