"""Each algorithm.policy_loss through a 2-rank GRPO run on CPU, each with a rollout correction on."""

import math

import pytest

from tests.conftest import run_torchrun
from tests.test_grpo_e2e import grpo_args, rows

pytestmark = pytest.mark.slow
CORRECTION_FRACTIONS = ("fidelity/correction_masked_token_frac", "fidelity/correction_masked_seq_frac",
                        "fidelity/correction_clipped_token_frac", "fidelity/correction_clipped_seq_frac")


@pytest.mark.parametrize("objective,correction", [("ppo", "icepop"), ("gspo", "mis"), ("cispo", "seq_mask_tis"),
                                                  ("sapo", "tis")])
def test_grpo_two_ranks_with_each_objective(tiny_model, clevr_parquet, tmp_path, objective, correction):
    run = tmp_path / objective
    knobs = [f"algorithm.policy_loss={objective}", f"algorithm.rollout_correction={correction}",
             "algorithm.ppo_epochs=2", "algorithm.loss_agg=seq-mean-token-mean"]
    run_torchrun(grpo_args(tiny_model, clevr_parquet, run, 2, knobs), nproc=2)
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2]
    for row in r:
        assert math.isfinite(row["loss/total"]) and math.isfinite(row["loss/grad_norm"])
        assert 0.0 <= row["loss/clip_fraction"] <= 1.0
        # the built-in engine matches the policy in fp32 (token_mult_prob_error ~1.0000002): no correction bites
        for key in CORRECTION_FRACTIONS:
            assert row[key] == 0.0, key
        assert abs(row["fidelity/correction_weight_mean"] - 1.0) < 1e-3
