"""rollout.exact on the GPU: vLLM's sampled-token logprobs equal the policy's bit for bit, and what it costs.

tools/logprob_check.py runs twice in fresh processes (batch-invariant mode is process-wide and is set before
vLLM is imported): with `--exact` and without, on the same prompts, 64 prompts x 4 responses (256 sequences)
of the tiny Qwen2.5-VL with 128-wide heads (tiny_hd128: the mode refuses narrower heads on an H200), or the
model in EXACT_MODEL (with EXACT_DATA, e.g. the 3B shape). The exact run must
give max |Δlogprob| == 0 over every sampled token; the test prints, and writes to EXACT_OUT when set, both
reports and the cost of the mode in generation, scoring and one training pass (%, exact against not).
EXACT_ARGS adds arguments to both runs.
If the exact run is not bitwise, `tools/op_diff.py --exact` names the first module that still differs
(tools/gpu_session.sh's exact stage runs it next). Skipped without CUDA or vLLM.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the exact mode needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, RESPONSES, NEW_TOKENS = 64, 4, 32


def _run(model: Path, data: Path, out: Path, exact: bool) -> dict:
    cmd = [sys.executable, str(ROOT / "tools" / "logprob_check.py"), "--model", str(model), "--data", str(data),
           "--engine", "vllm", "--num-prompts", str(PROMPTS), "--n", str(RESPONSES), "--max-new-tokens",
           str(NEW_TOKENS), "--min-pixels", os.environ.get("EXACT_MIN_PIXELS", "3136"),
           "--max-pixels", os.environ.get("EXACT_MAX_PIXELS", "12544"), "--time-train", "--out", str(out)]
    if exact:
        cmd.append("--exact")
    cmd += os.environ.get("EXACT_ARGS", "").split()  # e.g. --set model.activation_checkpointing=true
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=int(os.environ.get("EXACT_S", "280")))
    assert done.returncode == 0, f"logprob_check (exact={exact}) failed:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def _cost(exact: dict, plain: dict, key: str) -> float | None:
    if not exact.get(key) or not plain.get(key):  # a timing that did not run (train_error)
        return None
    return 100.0 * (exact[key] / plain[key] - 1.0)


def test_exact_mode_is_bitwise_and_reports_its_cost(tmp_path):
    from tools.make_dataset import make_dataset
    from tools.make_tiny_model import make_tiny_model

    model = Path(os.environ["EXACT_MODEL"]) if os.environ.get("EXACT_MODEL") else Path(make_tiny_model(
        tmp_path / "tiny_hd128", family="qwen2_5_vl", size="tiny_hd128", seed=0))
    data = Path(os.environ["EXACT_DATA"]) if os.environ.get("EXACT_DATA") else Path(make_dataset(
        "clevr", PROMPTS, 0, tmp_path / "clevr.parquet", size=(56, 56), max_objects=4))
    exact = _run(model, data, tmp_path / "exact.json", True)
    plain = _run(model, data, tmp_path / "plain.json", False)
    summary = {
        "model": model.name, "sequences": exact["sequences"], "tokens": exact["tokens"],
        "exact": {k: exact.get(k) for k in ("max_abs_dlogprob", "token_mult_prob_error_median",
                                        "token_mult_prob_error_max", "gen_s", "gen_warm_s", "score_warm_s", "train_s")},
        "not_exact": {k: plain.get(k) for k in ("max_abs_dlogprob", "token_mult_prob_error_median",
                                            "token_mult_prob_error_max", "gen_s", "gen_warm_s", "score_warm_s",
                                            "train_s")},
        # warm timings: gen_s also holds each engine's construction (eager against CUDA graphs)
        "cost_pct": {"generation": _cost(exact, plain, "gen_warm_s"), "scoring": _cost(exact, plain, "score_warm_s"),
                     "training": _cost(exact, plain, "train_s")},
        "exact_report": exact.get("exact_report"), "worst_tokens_exact": exact["worst_tokens"][:3],
        # docs/benchmarks.jsonl rows (issue 32's keys)
        "rows": [{"exact": r["exact"], "max_abs_dlogprob": r["max_abs_dlogprob"], "model": model.name,
                  "token_mult_prob_error_median": r["token_mult_prob_error_median"],
                  "token_mult_prob_error_max": r["token_mult_prob_error_max"], "sequences": r["sequences"],
                  "gen_warm_s": r.get("gen_warm_s"), "score_warm_s": r.get("score_warm_s"),
                  "train_s": r.get("train_s")}
                 for r in (exact, plain)],
    }
    print(json.dumps(summary, default=str), flush=True)
    if os.environ.get("EXACT_OUT"):
        Path(os.environ["EXACT_OUT"]).write_text(json.dumps({"summary": summary, "exact": exact, "plain": plain},
                                                            default=str) + "\n")
    assert exact["exact"] is True and plain["exact"] is False
    assert exact["sequences"] >= 256 and exact["tokens"] > 0
    assert exact["max_abs_dlogprob"] == 0.0, (
        f"exact mode: max |dlogprob| {exact['max_abs_dlogprob']:.3e} over {exact['tokens']} tokens; "
        "run tools/op_diff.py --exact for the first module that differs")
