"""Qwen3.5's packed Gated DeltaNet on a GPU: flash-linear-attention's varlen kernel against
transformers' torch rule run one sequence at a time, forward and backward."""

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the varlen delta rule needs CUDA", allow_module_level=True)
if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention (fla-core) is not installed", allow_module_level=True)

from models.families.qwen3_5 import _torch_rule, delta_rule_packed  # noqa: E402


def _inputs(lengths, k_heads=2, v_heads=4, dim=32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    make = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32)  # noqa: E731
    q, k = make(1, total, k_heads, dim), make(1, total, k_heads, dim)
    v = make(1, total, v_heads, dim)
    gate = -torch.rand(1, total, v_heads, generator=g, device="cuda")  # log decay <= 0
    beta = torch.rand(1, total, v_heads, generator=g, device="cuda")
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def test_fla_varlen_equals_torch_rule_per_sequence():
    lengths = [37, 5, 90, 64]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    inputs = _inputs(lengths)
    packed = delta_rule_packed(*inputs, cu)
    packed.square().sum().backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    outs = []
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i]) + n)
        q, k, v, gate, beta = (t[:, sl] for t in inputs)
        rep = v.shape[2] // k.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        out, _ = _torch_rule()(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        outs.append(out)
    reference = torch.cat(outs, dim=1)
    reference.square().sum().backward()
    scale = reference.abs().max().item()
    assert (packed - reference).abs().max().item() <= 2e-3 * max(scale, 1.0), "forward differs"
    for got, t in zip(grads, inputs):
        want = t.grad
        assert (got - want).abs().max().item() <= 5e-3 * max(want.abs().max().item(), 1.0), "gradient differs"
