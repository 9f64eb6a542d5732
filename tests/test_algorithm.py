"""Tests for grpo/algorithm.py against values worked out by hand or by plain-Python loops."""

import math
import statistics

import pytest
import torch

from grpo.algorithm import (
    aggregate_loss,
    compute_advantages,
    dynamic_sampling_keep,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    mismatch_sequence_mask,
    overlong_penalty,
    policy_loss,
    tis_weights,
    valid_counts,
)

LN2 = math.log(2.0)
NAN = float("nan")


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return torch.allclose(actual.detach().to(torch.float64), expected, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# advantages


def test_grpo_advantages_hand_values():
    # group 1: mean 0.25, unbiased var (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5
    # group 2: mean 0.5, unbiased var 4 * 0.25 / 3 = 1/3, std 1/sqrt(3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv = compute_advantages(rewards, 4, "grpo", eps=0.0)
    s = math.sqrt(3) / 2
    assert close(adv, [1.5, -0.5, -0.5, -0.5, s, s, -s, -s])
    with_eps = compute_advantages(rewards, 4, "grpo", eps=1e-6)
    assert close(with_eps[0], 0.75 / (0.5 + 1e-6), tol=1e-7)


def test_grpo_no_std_and_rloo_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert close(
        compute_advantages(rewards, 4, "grpo_no_std"), [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    )
    # r_i minus the mean of the other three
    assert close(
        compute_advantages(rewards, 4, "rloo"), [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3]
    )


def test_advantages_match_loop_reference():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(15, generator=gen, dtype=torch.float64)
    g = 5
    grpo = compute_advantages(rewards, g, "grpo", eps=1e-6)
    rloo = compute_advantages(rewards, g, "rloo")
    for start in range(0, 15, g):
        group = rewards[start : start + g].tolist()
        mean, std = statistics.fmean(group), statistics.stdev(group)
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            assert grpo[start + i].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-12)
            assert rloo[start + i].item() == pytest.approx(r - sum(others) / len(others), rel=1e-12)
            # the RLOO identity: r_i - mean(others) = G / (G - 1) * (r_i - mean)
            assert rloo[start + i].item() == pytest.approx(g / (g - 1) * (r - mean), rel=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_identical_rewards_give_exact_zero(estimator):
    # 0.1 is not exact in binary; r - mean leaves a residue that eps would blow up to ~1e-2
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.0])
    adv = compute_advantages(rewards, 3, estimator)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:6], torch.zeros(6))
    assert adv[6] > 0 and adv[7] < 0


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_group_of_one_gives_zero(estimator):
    adv = compute_advantages(torch.tensor([3.0, -1.0, 2.0]), 1, estimator)
    assert torch.equal(adv, torch.zeros(3))


def test_advantage_dtypes():
    assert compute_advantages(torch.tensor([1, 0, 1, 1]), 2).dtype == torch.float32
    assert compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2).dtype == torch.float64


def test_advantage_bad_input():
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(torch.tensor([1.0, NAN]), 2)
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.zeros(4), 0)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5 + 1e-9, 0.0, 0.0, 0.1])
    assert dynamic_sampling_keep(rewards, 3).tolist() == [False, True, False, True]
    assert dynamic_sampling_keep(torch.tensor([0.0, 1.0]), 1).tolist() == [False, False]


def test_overlong_penalty_ramp():
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, floor -penalty from 10 on
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    assert close(overlong_penalty(lengths, 10, 4), [0, 0, -0.25, -0.5, -0.75, -1.0, -1.0])
    assert close(overlong_penalty(lengths, 10, 4, penalty=0.5), [0, 0, -0.125, -0.25, -0.375, -0.5, -0.5])
    assert torch.equal(overlong_penalty(lengths, 10, 0), torch.zeros(7))
    assert overlong_penalty(lengths, 10, 10)[1].item() == pytest.approx(-0.6)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 11)


# --------------------------------------------------------------------------------------------
# KL and importance weights


def test_kl_estimators_hand_values():
    # pi = 0.5, ref = 0.25 at the sampled token: d = log 2
    logp, ref = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    assert close(kl_penalty(logp, ref, "k1"), [LN2, -LN2])
    assert close(kl_penalty(logp, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2])
    # k3 = ref/pi - 1 - log(ref/pi): 0.5 - 1 + ln 2 and 2 - 1 - ln 2
    assert close(kl_penalty(logp, ref, "k3"), [LN2 - 0.5, 1.0 - LN2])


def test_k1_and_k3_are_unbiased_for_kl():
    # exact expectation under pi (no sampling noise): sum_x pi(x) k(x) == KL(pi || ref)
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    exact = 0.5 * math.log(0.5 / 0.2) + 0.2 * math.log(0.2 / 0.5)
    for est in ("k1", "k3"):
        assert (pi * kl_penalty(pi.log(), ref.log(), est)).sum().item() == pytest.approx(exact, rel=1e-5)
    # k2 is biased: here it overestimates
    assert (pi * kl_penalty(pi.log(), ref.log(), "k2")).sum().item() > exact * 1.01


def test_kl_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(1)
    logp, ref = -5 * torch.rand(64, generator=gen), -5 * torch.rand(64, generator=gen)
    for est in ("k2", "k3"):
        assert (kl_penalty(logp, ref, est) >= 0).all()
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(logp, logp.clone(), est), torch.zeros(64))


def test_k3_clamps_extreme_log_ratio():
    out = kl_penalty(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]), "k3")
    assert torch.isfinite(out).all()
    assert close(out, [math.exp(20) - 21, math.exp(-20) + 19], tol=1e-5)


def test_kl_bad_input():
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="shapes must match"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")


def test_tis_weights_cap_and_detach():
    old = torch.tensor([[0.0, math.log(2.0), math.log(10.0), math.log(0.5)]], requires_grad=True)
    engine = torch.zeros(1, 4, requires_grad=True)
    w = tis_weights(old, engine, cap=3.0)
    assert close(w, [[1.0, 2.0, 3.0, 0.5]])
    assert not w.requires_grad
    assert torch.equal(tis_weights(old, engine, cap=0.0), torch.ones(1, 4))


# --------------------------------------------------------------------------------------------
# reductions


def ragged():
    # seq 0: four tokens, seq 1: two tokens, seq 2: none; masked slots hold NaN on purpose
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, NAN], [NAN, 7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    return per_token, mask


def test_aggregate_modes_local():
    per_token, mask = ragged()
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(21 / 6)
    # seq sums 10 and 11 over the two non-empty sequences
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(21 / 2)
    # seq means 2.5 and 5.5
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(8 / 2)


def test_aggregate_modes_global_denominators():
    per_token, mask = ragged()
    assert aggregate_loss(per_token, mask, "token-mean", global_tokens=12).item() == pytest.approx(21 / 12)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum", global_seqs=4).item() == pytest.approx(21 / 4)
    got = aggregate_loss(per_token, mask.bool(), "seq-mean-token-mean", global_seqs=torch.tensor(4.0))
    assert got.item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_microbatches_with_global_counts_sum_to_whole(mode):
    gen = torch.Generator().manual_seed(2)
    per_token = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) > 0.4
    mask[3] = False
    whole = aggregate_loss(per_token, mask, mode)
    tokens, seqs = valid_counts(mask)
    parts = [
        aggregate_loss(per_token[i : i + 2], mask[i : i + 2], mode, global_tokens=tokens, global_seqs=seqs)
        for i in range(0, 6, 2)
    ]
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-12)


def test_aggregate_matches_loop_reference():
    gen = torch.Generator().manual_seed(3)
    per_token = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=gen) > 0.5
    rows = [[v for v, m in zip(per_token[b].tolist(), mask[b].tolist()) if m] for b in range(4)]
    rows = [r for r in rows if r]
    flat = [v for r in rows for v in r]
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(sum(flat) / len(flat))
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(
        sum(sum(r) for r in rows) / len(rows)
    )
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(
        sum(sum(r) / len(r) for r in rows) / len(rows)
    )


def test_aggregate_nan_in_masked_slots_keeps_grad_finite():
    per_token, mask = ragged()
    per_token.requires_grad_(True)
    aggregate_loss(per_token, mask, "token-mean").backward()
    assert torch.isfinite(per_token.grad).all()
    assert close(per_token.grad, mask / 6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregate_empty_mask_is_zero_and_backprops(mode):
    x = torch.randn(2, 3, requires_grad=True)
    loss = aggregate_loss(x, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros(2, 3))


def test_aggregate_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(x, x, "sum")
    with pytest.raises(ValueError, match="shapes must match"):
        aggregate_loss(x, torch.zeros(2, 4), "token-mean")
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate_loss(x, x, "token-mean", global_tokens=-1)


def test_masked_mean_and_counts():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, 5.0, 6.0], [NAN, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 5 + 6) / 4)
    assert close(masked_mean(x, mask, dim=1), [1.5, 5.5, 0.0])
    assert close(masked_mean(x, mask, dim=0), [1.0, 3.5, 6.0])
    tokens, seqs = valid_counts(mask)
    assert (tokens.item(), seqs.item()) == (4.0, 2.0)


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(3, 4)).tolist() == pytest.approx([math.log(4)] * 3)
    assert entropy_from_logits(torch.tensor([1000.0, 1000.0])).item() == pytest.approx(LN2)
    assert entropy_from_logits(torch.tensor([0.0, -math.inf, -math.inf])).item() == 0.0
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for row, h in zip(logits.tolist(), entropy_from_logits(logits).tolist()):
        z = sum(math.exp(v) for v in row)
        assert h == pytest.approx(-sum(math.exp(v) / z * math.log(math.exp(v) / z) for v in row), rel=1e-5)


# --------------------------------------------------------------------------------------------
# policy loss


def logp_pair(ratios):
    """(logp, old_logp) with exp(logp - old_logp) == ratios; logp is a leaf that wants grads."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    logp = (old + torch.tensor(ratios).log()).requires_grad_(True)
    return logp, old.requires_grad_(True)


def test_policy_loss_clips_both_sides():
    # A=+1: r=1.5 clipped to 1.28 (high); r=0.5 and r=1.1 unclipped.
    # A=-1: r=0.5 clipped to 0.8 (low); r=1.5 and r=0.9 unclipped.
    logp, old = logp_pair([[1.5, 0.5, 1.1], [1.5, 0.5, 0.9]])
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    mask = torch.ones(2, 3)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    per_token = [-1.28, -0.5, -1.1, 1.5, 0.8, 0.9]
    assert loss.item() == pytest.approx(sum(per_token) / 6, rel=1e-5)
    assert m["clip_fraction"].item() == pytest.approx(2 / 6)
    assert m["clip_fraction_low"].item() == pytest.approx(1 / 6)
    assert m["clip_fraction_high"].item() == pytest.approx(1 / 6)
    assert m["dual_clip_fraction"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx(1.0, rel=1e-5)
    assert (m["ratio_max"].item(), m["ratio_min"].item()) == pytest.approx((1.5, 0.5), rel=1e-5)
    kl = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 1.5, 0.5, 0.9)]
    assert m["approx_kl"].item() == pytest.approx(sum(kl) / 6, rel=1e-4)
    assert m["tokens"].item() == 6
    loss.backward()
    # d(-A r)/dlogp = -A r where unclipped; 0 where the clipped term won
    assert close(logp.grad, [[0.0, -0.5 / 6, -1.1 / 6], [1.5 / 6, 0.0, 0.9 / 6]], tol=1e-5)
    assert old.grad is None and adv.grad is None


def test_policy_loss_dual_clip():
    # A=-1, c=3: r=4 gives max(4, 1.28)=4, capped at 3 with no gradient; r=2 stays 2.
    # A=+1 with r=4 is never dual-clipped (-1.28).
    logp, old = logp_pair([[4.0, 2.0], [4.0, 1.0]])
    adv = torch.tensor([-1.0, 1.0])
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.28 - 1.0) / 4, rel=1e-5)
    assert m["dual_clip_fraction"].item() == pytest.approx(1 / 4)
    assert m["clip_fraction"].item() == pytest.approx(1 / 4)  # the A=+1, r=4 token
    loss.backward()
    assert close(logp.grad, [[0.0, 2.0 / 4], [0.0, -1.0 / 4]], tol=1e-5)
    no_dual, _ = policy_loss(logp, old, adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.28)
    assert no_dual.item() == pytest.approx((4.0 + 2.0 - 1.28 - 1.0) / 4, rel=1e-5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2, dual_clip=0.5)


def test_policy_loss_tis_weights_scale_loss_and_stay_detached():
    logp, old = logp_pair([[1.1, 0.9]])
    weights = torch.tensor([[2.0, 0.5]], requires_grad=True)
    loss, _ = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2, tis_weights=weights
    )
    assert loss.item() == pytest.approx((-1.1 * 2.0 - 0.9 * 0.5) / 2, rel=1e-5)
    loss.backward()
    assert close(logp.grad, [[-1.1 * 2.0 / 2, -0.9 * 0.5 / 2]], tol=1e-5)
    assert weights.grad is None


def test_policy_loss_per_token_advantages_ragged_seq_mean():
    # ratio 1 everywhere (no clipping): per-token loss is -A; masked slots hold NaN advantages
    logp, old = logp_pair([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    kwargs = dict(clip_low=0.2, clip_high=0.28, loss_agg="seq-mean-token-mean")
    loss, m = policy_loss(logp, old, adv, mask, **kwargs)
    assert loss.item() == pytest.approx((-2.0 - 4.0) / 2)
    loss, _ = policy_loss(logp, old, adv, mask, global_seqs=6, **kwargs)
    assert loss.item() == pytest.approx((-2.0 - 4.0) / 6)
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, global_tokens=8)
    assert loss.item() == pytest.approx(-10.0 / 8)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert m["clip_fraction"].item() == 0.0 and m["tokens"].item() == 4


def test_policy_loss_garbage_in_masked_slots_stays_out_of_grad():
    logp = torch.tensor([[-1.0, NAN, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.0, NAN]])
    mask = torch.tensor([[True, False, False]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    r = math.exp(0.2)
    assert loss.item() == pytest.approx(-r, rel=1e-5)
    assert close(logp.grad, [[-r, 0.0, 0.0]], tol=1e-5)
    assert all(torch.isfinite(v) for v in m.values())


def test_policy_loss_empty_mask_metrics_are_zero():
    logp, old = logp_pair([[1.5, 0.5]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.zeros(1, 2), clip_low=0.2, clip_high=0.2)
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in m.values())


def test_policy_loss_bad_advantage_shape():
    logp, old = logp_pair([[1.0, 1.0]])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, torch.ones(3), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)


# --------------------------------------------------------------------------------------------
# engine / trainer mismatch


def test_mismatch_metrics_hand_values():
    # seq 0: d = ln(.25/.5) = -ln2 (e=2), d = 0 (e=1); seq 1: d = ln(.2/.1) = ln2 (e=2); seq 2 empty
    engine = torch.tensor([[math.log(0.5), math.log(0.25), NAN], [math.log(0.1), 0.0, 0.0], [NAN, 0.0, 0.0]])
    train = torch.tensor([[math.log(0.25), math.log(0.25), 0.0], [math.log(0.2), -50.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    m = mismatch_metrics(engine, train, mask)
    assert m["token_mult_prob_error_sum"].item() == pytest.approx(5.0, rel=1e-6)
    assert m["token_count"].item() == 3
    assert m["token_mult_prob_error"].item() == pytest.approx(5 / 3, rel=1e-6)
    assert close(m["seq_max_mult_prob_error"], [2.0, 2.0, 1.0], tol=1e-6)
    assert close(m["seq_mean_mult_prob_error"], [1.5, 2.0, 1.0], tol=1e-6)
    # k1: mean of engine - train = (ln2 + 0 - ln2) / 3; k3: (0.5 + ln2 - 1) + 0 + (2 - ln2 - 1) = 0.5
    assert m["gen_kl_k1"].item() == pytest.approx(0.0, abs=1e-6)
    assert m["gen_kl"].item() == pytest.approx(0.5 / 3, rel=1e-5)
    assert m["gen_kl_sum"].item() == pytest.approx(0.5, rel=1e-5)
    assert all(torch.isfinite(v).all() for v in m.values())


def test_mismatch_identical_logprobs():
    lp = -torch.rand(2, 4, generator=torch.Generator().manual_seed(5))
    m = mismatch_metrics(lp, lp.clone(), torch.ones(2, 4))
    assert m["token_mult_prob_error"].item() == 1.0
    assert m["gen_kl"].item() == 0.0 and m["gen_kl_k1"].item() == 0.0


def test_mismatch_sequence_mask():
    per_seq = torch.tensor([1.0, 1.5, 3.0])
    assert mismatch_sequence_mask(per_seq, 2.0).tolist() == [True, True, False]
    assert mismatch_sequence_mask(per_seq, 1.5).tolist() == [True, True, False]
    assert mismatch_sequence_mask(per_seq, 0.0).tolist() == [True, True, True]
