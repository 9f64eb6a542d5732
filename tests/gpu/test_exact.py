"""rollout.exact on the GPU: vLLM's sampled-token logprobs equal the policy's bit for bit, and what it costs.

tools/logprob_check.py runs twice in fresh processes (batch-invariant mode is process-wide and is set before
vLLM is imported): with `--exact` and without, on the same prompts, 64 prompts x 4 responses (256 sequences)
of the tiny Qwen2.5-VL with 128-wide heads (tiny_hd128: the mode refuses narrower heads on an H200), or the
model in EXACT_MODEL (with EXACT_DATA, e.g. the 3B shape). The exact run must
give max |Δlogprob| == 0 over every sampled token; the test prints, and writes to EXACT_OUT when set, both
reports and the cost of the mode in generation, scoring and one training pass (%, exact against not).
EXACT_ARGS adds arguments to both runs, EXACT_MODE_ARGS to the exact run alone (e.g.
`--set rollout.exact_cuda_graphs=true`: is the mode still bitwise with vLLM's decode steps from CUDA graphs, and
what does it cost then). EXACT_PROFILE=1 also writes each run's training pass under torch.profiler
(`tools/logprob_check.py --profile-train`), as NAME_exact_profile.txt and NAME_plain_profile.txt beside EXACT_OUT.
If the exact run is not bitwise, `tools/op_diff.py --exact` names the first module that still differs
(tools/gpu_session.sh's exact stage runs it next). Skipped without CUDA or vLLM.

Bisecting a mismatch (tools/gpu_session.sh's exact stage, EXACT_VARIANTS): EXACT_SIZE builds another
tools/make_tiny_model.py size (the `tiny_hd128_*` sizes add one feature of the 3b size each), EXACT_PX draws
EXACT_PX x EXACT_PX images (448: 1024 patches, the 3b run's images; the pixel limits follow unless EXACT_MIN_PIXELS
or EXACT_MAX_PIXELS are set), EXACT_ONLY=1 skips the run without the mode, EXACT_PROMPTS sets the prompts (64).
`test_kernel_probes_at_3b_shapes` runs `tools/op_diff.py --kernels`: cuBLAS's row invariance and FlashAttention's
prefill-decode invariance at the 3b size's shapes, on random tensors (EXACT_KERNELS_OUT keeps its report).
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
PROMPTS, RESPONSES, NEW_TOKENS = int(os.environ.get("EXACT_PROMPTS", "64")), 4, 32
SIZE = os.environ.get("EXACT_SIZE", "tiny_hd128")
SIDE = int(os.environ.get("EXACT_PX", "56"))  # the images' side in pixels
ONLY_EXACT = os.environ.get("EXACT_ONLY") == "1"


def _pixel_limits() -> tuple[str, str]:
    """The processor's min and max pixels: EXACT_MIN_PIXELS / EXACT_MAX_PIXELS, else the tiny sizes' own limits
    for 56-pixel images and exactly the image's area for larger ones (its grid as drawn)."""
    low, high = ("3136", "12544") if SIDE == 56 else (str(SIDE * SIDE),) * 2
    return os.environ.get("EXACT_MIN_PIXELS", low), os.environ.get("EXACT_MAX_PIXELS", high)


def _run(model: Path, data: Path, out: Path, exact: bool) -> dict:
    low, high = _pixel_limits()
    cmd = [sys.executable, str(ROOT / "tools" / "logprob_check.py"), "--model", str(model), "--data", str(data),
           "--engine", "vllm", "--num-prompts", str(PROMPTS), "--n", str(RESPONSES), "--max-new-tokens",
           str(NEW_TOKENS), "--min-pixels", low, "--max-pixels", high, "--out", str(out)]
    if not ONLY_EXACT:  # the cost needs both runs; a bisecting run wants the logprobs alone
        cmd.append("--time-train")
        if os.environ.get("EXACT_PROFILE") == "1":  # the training pass's op table, beside EXACT_OUT when set
            keep = Path(os.environ["EXACT_OUT"]) if os.environ.get("EXACT_OUT") else out
            cmd += ["--profile-train", str(keep.with_name(f"{keep.stem}_{'exact' if exact else 'plain'}_profile.txt"))]
    if exact:
        cmd.append("--exact")
        cmd += os.environ.get("EXACT_MODE_ARGS", "").split()  # the exact run's alone: --set rollout.exact_cuda_graphs=true
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
        tmp_path / SIZE, family="qwen2_5_vl", size=SIZE, seed=0))
    data = Path(os.environ["EXACT_DATA"]) if os.environ.get("EXACT_DATA") else Path(make_dataset(
        "clevr", PROMPTS, 0, tmp_path / "clevr.parquet", size=(SIDE, SIDE), max_objects=4))
    exact = _run(model, data, tmp_path / "exact.json", True)
    plain = {"exact": False} if ONLY_EXACT else _run(model, data, tmp_path / "plain.json", False)
    summary = {
        "model": model.name, "image_side": None if os.environ.get("EXACT_DATA") else SIDE, "sequences": exact["sequences"], "tokens": exact["tokens"],
        "exact": {k: exact.get(k) for k in ("max_abs_dlogprob", "token_mult_prob_error_median",
                                        "token_mult_prob_error_max", "gen_s", "gen_warm_s", "score_warm_s", "train_s")},
        "not_exact": {k: plain.get(k) for k in ("max_abs_dlogprob", "token_mult_prob_error_median",
                                            "token_mult_prob_error_max", "gen_s", "gen_warm_s", "score_warm_s",
                                            "train_s")},
        # warm timings: gen_s also holds each engine's construction (eager against CUDA graphs)
        "cost_pct": {"generation": _cost(exact, plain, "gen_warm_s"), "scoring": _cost(exact, plain, "score_warm_s"),
                     "training": _cost(exact, plain, "train_s")},
        "exact_report": exact.get("exact_report"), "worst_tokens_exact": exact["worst_tokens"][:3],
        # where the mismatch starts: a first sampled token (position 0) comes from the engine's prefill, the
        # others from decode steps
        "worst_positions_exact": sorted({w["pos"] for w in exact["worst_tokens"]}),
        # docs/benchmarks.jsonl rows (issue 32's keys)
        "rows": [{"exact": r["exact"], "max_abs_dlogprob": r["max_abs_dlogprob"], "model": model.name,
                  "token_mult_prob_error_median": r["token_mult_prob_error_median"],
                  "token_mult_prob_error_max": r["token_mult_prob_error_max"], "sequences": r["sequences"],
                  "gen_warm_s": r.get("gen_warm_s"), "score_warm_s": r.get("score_warm_s"),
                  "train_s": r.get("train_s")}
                 for r in (exact, plain) if "max_abs_dlogprob" in r],
    }
    print(json.dumps(summary, default=str), flush=True)
    if os.environ.get("EXACT_OUT"):
        Path(os.environ["EXACT_OUT"]).write_text(json.dumps({"summary": summary, "exact": exact, "plain": plain},
                                                            default=str) + "\n")
    assert exact["exact"] is True and plain["exact"] is False
    assert exact["sequences"] >= PROMPTS * RESPONSES and exact["tokens"] > 0
    assert exact["max_abs_dlogprob"] == 0.0, (
        f"exact mode: max |dlogprob| {exact['max_abs_dlogprob']:.3e} over {exact['tokens']} tokens; "
        "run tools/op_diff.py --exact for the first module that differs")


def test_kernel_probes_at_3b_shapes(tmp_path):
    """cuBLAS gives a row the same bits at any row count, and vLLM's FlashAttention a token the same bits in a
    decode step as in a prefill, at the 3b size's shapes (tools/op_diff.py --kernels, a process of its own: the
    exact mode's cuBLAS settings must come before its first GEMM)."""
    from tools.op_diff import ATTENTION_WAYS

    out = Path(os.environ.get("EXACT_KERNELS_OUT") or tmp_path / "kernels.json")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "op_diff.py"), "--kernels", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=int(os.environ.get("EXACT_S", "280")))
    print(done.stdout[-6000:], flush=True)
    assert done.returncode == 0, f"op_diff --kernels failed:\n{done.stderr[-4000:]}"
    report = json.loads(out.read_text())
    broken = [name for name, r in report["gemm_engine"].items() if not r["bitwise"]] + [  # what all_bitwise reads
        f"attention {name} {way}" for name, r in report["attention"].items() for way in ATTENTION_WAYS
        if not r[way]["bitwise"]]
    assert report["all_bitwise"], f"not bitwise at the 3b shapes: {', '.join(broken)}"
