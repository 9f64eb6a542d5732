"""The built-in engine holds token_mult_prob_error ≤ 1.0001 against the policy: packed and padded, 1 and 2 ranks."""

import json
import sys

import pytest

from tests.conftest import ROOT, run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc,packing", [(1, "packed"), (2, "padded"), (2, "packed")])
def test_torch_engine_matches_policy(tiny_model, clevr_parquet, tmp_path, nproc, packing):
    out, png = tmp_path / "lp.json", tmp_path / "lp.png"
    run_torchrun([str(ROOT / "tools" / "logprob_check.py"), "--model", str(tiny_model), "--data", str(clevr_parquet),
                  "--engine", "torch", "--num-prompts", "4", "--responses-per-prompt", "2", "--max-new-tokens", "12",
                  "--temperature", "0.8", "--packing", packing, "--min-pixels", "3136", "--max-pixels", "12544",
                  "--out", str(out), "--png", str(png),
                  *(["--time-train", "--profile-train", str(tmp_path / "train.txt")] if nproc == 1 else [])], nproc=nproc)
    report = json.loads(out.read_text())
    assert report["ranks"] == nproc and report["packing"] == packing and report["sequences"] == 8
    tmpe = report["token_mult_prob_error"]
    assert 1.0 <= tmpe["median"] <= tmpe["max"] <= 1.0001
    assert report["tokens"] > 0 and 0 <= report["gen_kl"] < 1e-6
    assert report["packed_vs_padded_max_abs_dlogp"] < 1e-5
    assert report["worst_tokens"] and png.stat().st_size > 1000
    if nproc == 1:  # the cost timings: once more with everything warm, and one forward and backward
        assert report["gen_warm_s"] > 0 and report["score_warm_s"] > 0 and report["train_s"] > 0
        table = (tmp_path / "train.txt").read_text()  # the training pass under torch.profiler: its backward ran
        assert table.startswith("profiled step:") and "autograd::engine::evaluate_function" in table
