"""The packed per-token form (K,) with segment ids gives the padded (B, T) form's losses, gradients
and mismatch metrics: the trainer keeps every per-token field packed through the whole step."""

import pytest
import torch

from grpo import algorithm as alg

LENGTHS = [5, 1, 9, 3]


def _padded_and_packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    mask[2, 4] = False  # a masked token inside a sequence (mismatch-masked or weighted out)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64).float() * 3
    old = logp + torch.randn(B, T, generator=g) * 0.3
    ref = logp + torch.randn(B, T, generator=g) * 0.2
    eng = logp + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, generator=g)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        valid[b, :n] = True
    seg = torch.cat([torch.full((n,), b) for b, n in enumerate(LENGTHS)])
    pack = lambda x: x[valid]  # noqa: E731  row-major: sequence by sequence, tokens in order
    return dict(mask=mask, logp=logp, old=old, ref=ref, eng=eng, adv=adv, valid=valid, seg=seg, pack=pack)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip,tis_cap", [(0.0, 0.0), (3.0, 2.0)])
def test_packed_policy_loss_matches_padded(agg, dual_clip, tis_cap):
    d = _padded_and_packed()
    pack, seg = d["pack"], d["seg"]
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, loss_agg=agg, global_tokens=20.0, global_seqs=6.0)

    lp_pad = d["logp"].clone().requires_grad_(True)
    tis_pad = alg.tis_weights(d["old"], d["eng"], tis_cap) if tis_cap else None
    loss_pad, m_pad = alg.policy_loss(lp_pad, d["old"], d["adv"], d["mask"], tis_weights=tis_pad, **kw)
    kl_pad = alg.aggregate_loss(alg.kl_penalty(lp_pad, d["ref"], "k3"), d["mask"], agg, global_tokens=20.0,
                                global_seqs=6.0)
    (loss_pad + 0.1 * kl_pad).backward()

    lp_pk = pack(d["logp"]).clone().requires_grad_(True)
    tis_pk = alg.tis_weights(pack(d["old"]), pack(d["eng"]), tis_cap) if tis_cap else None
    loss_pk, m_pk = alg.policy_loss(lp_pk, pack(d["old"]), d["adv"][seg], pack(d["mask"]), tis_weights=tis_pk,
                                    segments=seg, num_segments=len(LENGTHS), **kw)
    kl_pk = alg.aggregate_loss(alg.kl_penalty(lp_pk, pack(d["ref"]), "k3"), pack(d["mask"]), agg, global_tokens=20.0,
                               global_seqs=6.0, segments=seg, num_segments=len(LENGTHS))
    (loss_pk + 0.1 * kl_pk).backward()

    assert loss_pad.item() != 0
    assert abs(loss_pad.item() - loss_pk.item()) <= 1e-6
    assert abs(kl_pad.item() - kl_pk.item()) <= 1e-6
    assert torch.allclose(pack(lp_pad.grad), lp_pk.grad, atol=1e-6, rtol=0)
    assert lp_pk.grad.abs().sum() > 0
    for k in m_pad:
        assert torch.allclose(m_pad[k], m_pk[k], atol=1e-6), k


def test_packed_local_counts_match_padded():
    d = _padded_and_packed()
    mask = d["mask"].clone()
    mask[1] = False  # a sequence with no valid token does not count
    tokens, seqs = alg.valid_counts(mask)
    p_tokens, p_seqs = alg.valid_counts(d["pack"](mask), d["seg"], len(LENGTHS))
    assert (tokens, seqs) == (p_tokens, p_seqs) and seqs == 3


def test_packed_mismatch_metrics_match_padded():
    d = _padded_and_packed()
    pad = alg.mismatch_metrics(d["eng"], d["old"], d["mask"])
    pk = alg.mismatch_metrics(d["pack"](d["eng"]), d["pack"](d["old"]), d["pack"](d["mask"]), segments=d["seg"],
                              num_segments=len(LENGTHS))
    for k in pad:
        assert torch.allclose(pad[k], pk[k], atol=1e-6), k
    assert pad["seq_max_mult_prob_error"].shape == (len(LENGTHS),)


def test_packed_form_rejects_missing_segments():
    with pytest.raises(ValueError, match="logp"):
        alg.policy_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.ones(4, dtype=torch.bool),
                        clip_low=0.2, clip_high=0.2)
