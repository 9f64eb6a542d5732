"""GSPO, CISPO and SAPO objectives and the rollout corrections: values and gradients against examples
worked out by hand (with `math`, not torch), and the packed (K,) form against the padded (B, T) one."""

import math

import pytest
import torch

from grpo import algorithm as alg


def close(actual, expected, tol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float64).flatten().tolist()
    expected = torch.as_tensor(expected, dtype=torch.float64).flatten().tolist()
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= tol, (actual, expected)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------------------------
# GSPO


def gspo_example():
    """Two sequences: 2 tokens with log-ratios 0.2 and 0 (A = 1), 1 token with log-ratio -0.3 (A = -2)."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.0], [-0.2, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    return logp, old, torch.tensor([1.0, -2.0]), mask


def test_gspo_hand_values_and_gradients_seq_mean():
    logp, old, adv, mask = gspo_example()
    loss, m = alg.gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean")
    loss.backward()
    s0 = math.exp((0.2 + 0.0) / 2)  # 1.105: inside [0.8, 1.2], unclipped
    s1 = math.exp(-0.3)  # 0.741 < 0.8 with A < 0: the clipped term -A * 0.8 = 1.6 is larger, no gradient
    close(loss, (-1.0 * s0 + 1.6) / 2)
    # d(-A s0)/dlogp_t = -A s0 / |y| per token, then / 2 sequences
    close(logp.grad, [[-s0 / 2 / 2, -s0 / 2 / 2], [0.0, 0.0]])
    close(m["clip_fraction"], 1 / 3)
    close(m["clip_fraction_low"], 1 / 3)
    close(m["clip_fraction_high"], 0.0)
    close(m["seq_clip_fraction"], 0.5)
    close(m["seq_ratio_mean"], (s0 + s1) / 2)


def test_gspo_hand_values_and_gradients_token_mean_and_clip_high():
    logp, old, adv, mask = gspo_example()
    loss, _ = alg.gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="token-mean")
    loss.backward()
    s0 = math.exp(0.1)
    close(loss, (-s0 * 2 + 1.6) / 3)  # each token of a sequence carries the sequence's term
    close(logp.grad, [[-s0 / 3, -s0 / 3], [0.0, 0.0]])  # 2 copies * s0 / 2 / 3 tokens

    logp, old, adv, mask = gspo_example()
    loss, m = alg.gspo_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05, loss_agg="seq-mean-token-mean")
    loss.backward()
    close(loss, (-1.05 + 2 * 0.95) / 2)  # both sequences clipped: s0 > 1.05 with A > 0, s1 < 0.95 with A < 0
    close(logp.grad, [[0.0, 0.0], [0.0, 0.0]])
    close(m["clip_fraction_high"], 2 / 3)
    close(m["seq_clip_fraction"], 1.0)


def test_gspo_ratio_is_length_normalised():
    """One token moved by d in a sequence of n tokens moves the sequence ratio by exp(d / n)."""
    n, d = 8, 0.4
    logp = torch.zeros(1, n)
    old = logp.clone()
    old[0, 3] = -d
    _, m = alg.gspo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, n, dtype=torch.bool), clip_low=1.0,
                         clip_high=1.0)
    close(m["seq_ratio_mean"], math.exp(d / n))


# --------------------------------------------------------------------------------------------
# CISPO


def cispo_example():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -0.2]])  # r = e^0.5 = 1.649, 1, e^-0.3 = 0.741
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    return logp, old, adv, torch.ones(1, 3, dtype=torch.bool)


def test_cispo_hand_values_and_gradients():
    logp, old, adv, mask = cispo_example()
    loss, m = alg.cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    w = [1.28, 1.0, 0.8]  # clip(r, 0.8, 1.28): the first token clipped high, the third low
    a = [1.0, 1.0, -1.0]
    lp = [-1.0, -2.0, -0.5]
    close(loss, sum(-wi * ai * li for wi, ai, li in zip(w, a, lp)) / 3)
    # clipped tokens keep a gradient -w A / N (PPO would give them 0)
    close(logp.grad, [[-wi * ai / 3 for wi, ai in zip(w, a)]])
    close(m["clip_fraction"], 2 / 3)
    close(m["clip_fraction_high"], 1 / 3)
    close(m["clip_fraction_low"], 1 / 3)


def test_cispo_default_has_no_lower_bound():
    logp, old, adv, mask = cispo_example()
    loss, m = alg.cispo_loss(logp, old, adv, mask)  # clip_low=1: weights in [0, 5]
    loss.backward()
    r = [math.exp(0.5), 1.0, math.exp(-0.3)]
    close(logp.grad, [[-r[0] / 3, -r[1] / 3, r[2] / 3]])
    close(m["clip_fraction"], 0.0)


# --------------------------------------------------------------------------------------------
# SAPO


def sapo_example():
    log_r = [0.0, math.log(2.0), -math.log(2.0), 2.0]
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    old = logp.detach() - torch.tensor([log_r])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    return logp, old, adv, torch.ones(1, 4, dtype=torch.bool), log_r


def test_sapo_hand_values_and_gradients():
    logp, old, adv, mask, log_r = sapo_example()
    loss, m = alg.sapo_loss(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    loss.backward()
    values, grads, gates = [], [], []
    for lr, a in zip(log_r, [1.0, 1.0, -1.0, 1.0]):
        r = math.exp(lr)
        tau = 1.0 if a > 0 else 1.05
        sig = sigmoid(tau * (r - 1))
        values.append(-a * 4 / tau * sig)
        gates.append(4 * sig * (1 - sig))
        grads.append(-a * gates[-1] * r / 4)  # d/dlogp of -A (4/tau) sigmoid(tau (r - 1)), / 4 tokens
    close(loss, sum(values) / 4)
    close(logp.grad, [grads])
    assert abs(grads[0] - (-0.25)) < 1e-7  # on-policy the gate is 1: the plain policy gradient -A / N
    # the last token (r = e^2) keeps 0.7% of its gradient: soft-clipped high; the others keep > 50%
    close(m["clip_fraction"], 0.25)
    close(m["clip_fraction_high"], 0.25)
    close(m["clip_fraction_low"], 0.0)
    close(m["gate_mean"], sum(gates) / 4)


def test_sapo_negative_temperature_decays_faster():
    """A larger tau shrinks the gate faster away from r = 1 (the paper: tau_neg > tau_pos)."""
    logp = torch.zeros(1, 1, requires_grad=True)
    old = torch.full((1, 1), -0.5)
    grads = []
    for tau in (1.0, 2.0):
        logp.grad = None
        loss, _ = alg.sapo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), tau_neg=tau)
        loss.backward()
        grads.append(abs(logp.grad.item()))
    assert grads[1] < grads[0]


def test_objective_loss_dispatches_and_ppo_matches_policy_loss():
    logp, old, adv, mask = cispo_example()
    ppo, m1 = alg.objective_loss("ppo", logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ref, m2 = alg.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert ppo.item() == ref.item() and m1.keys() == m2.keys()
    cispo, _ = alg.objective_loss("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert cispo.item() == alg.cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0].item()
    with pytest.raises(ValueError, match="objective"):
        alg.objective_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)


@pytest.mark.parametrize("objective", ["gspo", "cispo", "sapo"])
def test_objectives_keep_garbage_in_masked_slots_out(objective):
    logp = torch.tensor([[-1.0, float("nan")], [-0.5, float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.1, float("nan")], [-0.4, 3.0]])
    mask = torch.tensor([[True, False], [True, False]])
    weights = torch.tensor([[1.0, float("nan")], [1.0, 0.0]])
    loss, m = alg.objective_loss(objective, logp, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2,
                                 clip_high=0.2, weights=weights.masked_fill(~mask, 0.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 1] == 0
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("objective", ["gspo", "cispo", "sapo"])
def test_objectives_weights_scale_the_loss(objective):
    logp, old, adv, mask = cispo_example()
    base, _ = alg.objective_loss(objective, logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    half, _ = alg.objective_loss(objective, logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                 weights=torch.full((1, 3), 0.5))
    assert base.item() != 0
    close(half, base.item() / 2)


# --------------------------------------------------------------------------------------------
# rollout corrections


def correction_example():
    """Two sequences: log w = [ln 3, 0, -ln 4] (w = 3, 1, 0.25) and [0.001, 0.0005]."""
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    log_w = torch.tensor([[math.log(3.0), 0.0, -math.log(4.0)], [0.001, 0.0005, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return engine + log_w, engine, mask


def test_correction_none_and_tis():
    old, eng, mask = correction_example()
    w, c = alg.rollout_correction(old, eng, mask, "none")
    close(w, mask.float())
    close([c["masked_tokens"], c["clipped_tokens"], c["tokens"], c["seqs"]], [0, 0, 5, 2])
    w, c = alg.rollout_correction(old, eng, mask, "tis", tis_cap=2.0)
    close(w, [[2.0, 1.0, 0.25], [math.exp(0.001), math.exp(0.0005), 0.0]])
    close([c["clipped_tokens"], c["clipped_seqs"], c["masked_tokens"]], [1, 1, 0])
    close(w, alg.tis_weights(old, eng, 2.0) * mask)  # the same weights the old tis_cap path used


def test_correction_icepop():
    old, eng, mask = correction_example()
    w, c = alg.rollout_correction(old, eng, mask, "icepop", icepop_low=0.5, icepop_high=5.0)
    close(w, [[3.0, 1.0, 0.0], [math.exp(0.001), math.exp(0.0005), 0.0]])  # 0.25 < 0.5: masked
    close([c["masked_tokens"], c["masked_seqs"], c["weight_sum"]],
          [1, 1, 4.0 + math.exp(0.001) + math.exp(0.0005)])
    w, c = alg.rollout_correction(old, eng, mask, "icepop", icepop_low=0.2, icepop_high=2.0)
    close(w[0], [0.0, 1.0, 0.25])  # now 3 > 2 is the one masked


def test_correction_mis():
    old, eng, mask = correction_example()
    w, c = alg.rollout_correction(old, eng, mask, "mis", mis_cap=2.0)
    rho1 = math.exp(0.0015)
    close(w, [[0.75, 0.75, 0.75], [rho1, rho1, 0.0]])  # 3 * 1 * 0.25 on each token of the first
    close(c["masked_seqs"], 0)
    w, c = alg.rollout_correction(old, eng, mask, "mis", mis_cap=1.001)
    close(w, [[0.75, 0.75, 0.75], [0.0, 0.0, 0.0]])  # 1.0015 > 1.001: the second sequence is dropped
    close([c["masked_tokens"], c["masked_seqs"]], [2, 1])


def test_correction_seq_mask_tis():
    old, eng, mask = correction_example()
    w, c = alg.rollout_correction(old, eng, mask, "seq_mask_tis", seq_mask_low=0.999, seq_mask_high=1.002)
    # geometric means: 0.75 ** (1/3) = 0.909 (dropped), exp(0.00075) = 1.00075 (kept, token weights w)
    close(w, [[0.0, 0.0, 0.0], [math.exp(0.001), math.exp(0.0005), 0.0]])
    close([c["masked_tokens"], c["masked_seqs"], c["seqs"]], [3, 1, 2])


def test_correction_rejects_unknown_mode():
    old, eng, mask = correction_example()
    with pytest.raises(ValueError, match="mode"):
        alg.rollout_correction(old, eng, mask, "veto")


# --------------------------------------------------------------------------------------------
# packed (K,) == padded (B, T)

LENGTHS = [5, 1, 9, 3]


def padded_and_packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        valid[b, :n] = True
    mask = valid.clone()
    mask[2, 4] = False  # a masked token inside a sequence
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + torch.randn(B, T, generator=g) * 0.3
    eng = old + torch.randn(B, T, generator=g) * 0.2
    old[0, 0] = logp[0, 0] - 3.0  # one token far off-policy (r = e^3): every objective clips or gates it
    adv = torch.randn(B, generator=g)
    seg = torch.cat([torch.full((n,), b) for b, n in enumerate(LENGTHS)])
    return dict(mask=mask, logp=logp, old=old, eng=eng, adv=adv, seg=seg, pack=lambda x: x[valid])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("objective", ["gspo", "cispo", "sapo"])
def test_packed_objective_matches_padded(objective, agg):
    d = padded_and_packed()
    pack, seg = d["pack"], d["seg"]
    clip = (0.2, 0.28)
    kw = dict(clip_low=clip[0], clip_high=clip[1], loss_agg=agg, global_tokens=20.0, global_seqs=6.0)
    w_pad, _ = alg.rollout_correction(d["old"], d["eng"], d["mask"], "icepop", icepop_low=0.8, icepop_high=1.25)

    lp_pad = d["logp"].clone().requires_grad_(True)
    loss_pad, m_pad = alg.objective_loss(objective, lp_pad, d["old"], d["adv"], d["mask"], weights=w_pad, **kw)
    loss_pad.backward()
    lp_pk = pack(d["logp"]).clone().requires_grad_(True)
    loss_pk, m_pk = alg.objective_loss(objective, lp_pk, pack(d["old"]), d["adv"][seg], pack(d["mask"]),
                                       weights=pack(w_pad), segments=seg, num_segments=len(LENGTHS), **kw)
    loss_pk.backward()

    assert loss_pad.item() != 0 and lp_pk.grad.abs().sum() > 0
    assert abs(loss_pad.item() - loss_pk.item()) <= 1e-6
    assert torch.allclose(pack(lp_pad.grad), lp_pk.grad, atol=1e-6, rtol=0)
    assert m_pad.keys() == m_pk.keys()
    for k in m_pad:
        assert torch.allclose(m_pad[k], m_pk[k], atol=1e-6), k
    assert m_pad["clip_fraction"] > 0  # the example exercises the clip


@pytest.mark.parametrize("mode", ["none", "tis", "icepop", "mis", "seq_mask_tis"])
def test_packed_correction_matches_padded(mode):
    d = padded_and_packed(1)
    kw = dict(tis_cap=1.2, icepop_low=0.8, icepop_high=1.25, mis_cap=1.05, seq_mask_low=0.95, seq_mask_high=1.05)
    w_pad, c_pad = alg.rollout_correction(d["old"], d["eng"], d["mask"], mode, **kw)
    w_pk, c_pk = alg.rollout_correction(d["pack"](d["old"]), d["pack"](d["eng"]), d["pack"](d["mask"]), mode,
                                        segments=d["seg"], num_segments=len(LENGTHS), **kw)
    assert torch.allclose(d["pack"](w_pad), w_pk, atol=1e-6)
    for k in alg.CORRECTION_COUNTS:
        assert torch.allclose(c_pad[k], c_pk[k], atol=1e-5), k
    if mode != "none":
        assert c_pad["masked_tokens"] + c_pad["clipped_tokens"] > 0  # the thresholds bite in this example
