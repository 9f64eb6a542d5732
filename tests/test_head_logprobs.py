"""The scored tokens' logprobs through a plain lm_head in one autograd node (models.logits.head_logprobs) against
the chunk-by-chunk path it replaces (models.policy._chunk_logprobs under activation checkpointing): the same
forward bits, the same gradients, and the heads it leaves to that path."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.logits import head_logprobs
from models.policy import _chunk_logprobs

HIDDEN, VOCAB, CHUNK = 64, 300, 16


def _setup(dtype: torch.dtype, rows: int = 45, seed: int = 0):
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.mul_(4.0)  # logits of a few units, so the softmax is far from uniform
    h = torch.randn(rows, HIDDEN).mul(2).to(dtype)
    targets = torch.randint(0, VOCAB, (rows,))
    upstream = torch.randn(rows)
    return head, h, targets, upstream


def _chunked(head, h, targets, temperature, fp32, with_entropy):
    """The chunk-by-chunk path, each chunk checkpointed, as the policy ran every head before."""
    lps, ents = [], []
    for start in range(0, h.shape[0], CHUNK):
        lp, ent = checkpoint(_chunk_logprobs, head, h[start:start + CHUNK], targets[start:start + CHUNK],
                             temperature, with_entropy, None, None, fp32, use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _grads(fn, head, h, targets, upstream, temperature, fp32, with_entropy):
    head.zero_grad()
    x = h.clone().requires_grad_(True)
    lp, ent = fn(head, x, targets, temperature, fp32, with_entropy)
    (lp * upstream).sum().backward()
    return lp.detach(), ent, x.grad, head.weight.grad.clone()


def _fused(head, h, targets, temperature, fp32, with_entropy):
    return head_logprobs(head, h, targets, temperature, fp32, CHUNK, with_entropy)


@pytest.mark.parametrize("dtype,fp32", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_bits_and_gradients_match_the_chunked_path(dtype, fp32, temperature):
    head, h, targets, upstream = _setup(dtype)
    lp, ent, gh, gw = _grads(_fused, head, h, targets, upstream, temperature, fp32, True)
    ref_lp, ref_ent, ref_gh, ref_gw = _grads(_chunked, head, h, targets, upstream, temperature, fp32, True)
    assert lp.dtype == torch.float32 and lp.shape == (h.shape[0],)
    assert torch.equal(lp, ref_lp)  # the same products and reductions: the same bits
    assert torch.equal(ent, ref_ent)
    assert not ent.requires_grad
    assert gh.dtype == dtype and gw.dtype == dtype
    assert torch.equal(gh, ref_gh)  # the same softmax gradient, cast the same way, times the same weight
    # the weight's gradient sums the chunks inside the product (one rounding a chunk, as before)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(gw.float(), ref_gw.float(), rtol=tol, atol=tol * ref_gw.float().abs().max().item())


def test_the_gradient_is_the_softmax_rule_in_float64():
    """Against autograd on an unchunked float64 reference, so a wrong sign or a missing temperature fails (the
    logits are fp32, as `head(h).float()` makes them, hence the tolerance)."""
    head, h, targets, upstream = _setup(torch.float64, rows=20)
    lp, _, gh, gw = _grads(_fused, head, h, targets, upstream, 0.5, False, False)
    w = head.weight.detach().clone().requires_grad_(True)
    x = h.clone().requires_grad_(True)
    ref = torch.log_softmax(x @ w.t() / 0.5, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * upstream).sum().backward()
    assert torch.allclose(lp.double(), ref.detach(), atol=1e-6)
    assert torch.allclose(gh, x.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)
    assert not torch.allclose(gh, -x.grad, atol=1e-2)


def test_a_frozen_head_gets_no_gradient_and_no_entropy_is_made_unasked():
    head, h, targets, upstream = _setup(torch.float32)
    head.requires_grad_(False)
    x = h.clone().requires_grad_(True)
    lp, ent = head_logprobs(head, x, targets, 1.0, False, CHUNK, False)
    assert ent is None
    (lp * upstream).sum().backward()
    assert head.weight.grad is None and x.grad is not None and torch.isfinite(x.grad).all()


def test_without_grad_it_matches_the_plain_chunks():
    head, h, targets, _ = _setup(torch.bfloat16)
    with torch.no_grad():
        lp, ent = head_logprobs(head, h, targets, 0.7, True, CHUNK, True)
        ref_lp, ref_ent = _chunked(head, h, targets, 0.7, True, True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)


def test_heads_other_than_a_plain_projection_are_left_to_the_chunked_path():
    _, h, targets, _ = _setup(torch.bfloat16)
    biased = nn.Linear(HIDDEN, VOCAB).to(torch.bfloat16)
    assert head_logprobs(biased, h, targets, 1.0, True, CHUNK, False) is None
    other_dtype = nn.Linear(HIDDEN, VOCAB, bias=False)  # fp32 weight, bf16 hidden states
    assert head_logprobs(other_dtype, h, targets, 1.0, True, CHUNK, False) is None
    patched = nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
    patched.forward = lambda x: x @ patched.weight.t() * 2  # exact mode patches the instance's forward
    assert head_logprobs(patched, h, targets, 1.0, True, CHUNK, False) is None
    hooked = nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
    hooked.register_forward_hook(lambda m, args, out: out * 0)
    assert head_logprobs(hooked, h, targets, 1.0, True, CHUNK, False) is None

    class Capped(nn.Linear):
        def forward(self, x):
            return torch.tanh(super().forward(x))

    assert head_logprobs(Capped(HIDDEN, VOCAB, bias=False).to(torch.bfloat16), h, targets, 1.0, True, CHUNK,
                         False) is None
