"""model.flash_direct: the varlen attention calls torch's FlashAttention ops through `FlashVarlen` (no K/V heads
repeated, no custom-operator layer). The ops are CUDA-only, so here they are stand-ins with the aten ops'
signatures that compute reference attention over the same segments: what is checked is everything around the
kernel (its arguments, the grouped K/V handed over unrepeated, the shared prompts' gathered keys, the backward's
wiring), against the per-segment SDPA reference. tests/gpu/test_flash_direct.py runs the real kernels."""

from __future__ import annotations

import pytest
import torch

from models import attention
from models.attention import _run_kernel, reference_attention


def fake_ops(seen: list):
    def attend(q, k, v, cu_q, cu_k, causal, scale):
        if causal:
            return reference_attention(q, k, v, cu_q, scale, (torch.arange(k.shape[0]), cu_k, None))
        bounds = cu_q.tolist()
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            parts.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale,
                                                                          enable_gqa=True).transpose(0, 1))
        return torch.cat(parts)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale=None):
        seen.append({"heads": (q.shape[1], k.shape[1]), "max": (max_q, max_k), "dropout": dropout, "debug": debug,
                     "contiguous": all(t.is_contiguous() for t in (q, k, v))})
        return attend(q, k, v, cu_q, cu_k, causal, scale), torch.zeros(q.shape[1], q.shape[0]), \
            torch.zeros(2), torch.empty(0), torch.empty(0)

    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, scale=None):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            return torch.autograd.grad(attend(q, k, v, cu_q, cu_k, causal, scale), (q, k, v), grad)

    return forward, backward


@pytest.fixture
def direct(monkeypatch):
    seen: list = []
    monkeypatch.setattr(attention, "_flash_ops", lambda: fake_ops(seen))
    monkeypatch.setattr(attention, "_DIRECT_FLASH", [True])
    return seen


def _inputs(heads: int, kv_heads: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, length, 8, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _grads(out, inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out))


def test_a_packed_row_with_grouped_heads_matches_the_reference(direct):
    q, k, v = _inputs(4, 2, 11)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    out = _run_kernel(q, k, v, cu, 7, 0.3, causal=True)
    want = reference_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, 0.3).unsqueeze(0)
    torch.testing.assert_close(out, want)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(got, ref)
    assert direct == [{"heads": (4, 2), "max": (7, 7), "dropout": 0.0, "debug": False, "contiguous": True}]


def test_shared_prompt_keys_and_vision_windows_reach_the_kernel(direct):
    q, k, v = _inputs(4, 2, 9, seed=1)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    kv_index = torch.tensor([0, 1, 2, 0, 1, 3, 4], dtype=torch.int64)  # segment 2 sees the prompt rows 0-1 again
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)
    qs = q[:, :, :5]
    out = _run_kernel(qs, k, v, cu_q, 3, None, True, (kv_index, cu_k, 4))
    want = reference_attention(*(t[0].transpose(0, 1) for t in (qs, k, v)), cu_q, None, (kv_index, cu_k, 4))
    torch.testing.assert_close(out[0], want)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want.unsqueeze(0), (q, k, v))):
        torch.testing.assert_close(got, ref)
    assert direct[-1]["heads"] == (4, 2) and direct[-1]["max"] == (3, 4)
    qv, kv, vv = _inputs(3, 3, 6, seed=2)  # a vision tower's windows: bidirectional within each
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = _run_kernel(qv, kv, vv, cu, 4, None, causal=False)
    for a, b in ((0, 2), (2, 6)):
        ref = torch.nn.functional.scaled_dot_product_attention(qv[:, :, a:b], kv[:, :, a:b], vv[:, :, a:b])
        torch.testing.assert_close(out[0, a:b], ref[0].transpose(0, 1))


def test_the_setting_switches_the_path_for_the_process(tiny_model):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    try:
        build_policy(ModelConfig(path=str(tiny_model), flash_direct=True), build_parallel_dims())
        assert attention._DIRECT_FLASH[0] is True
        build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
        assert attention._DIRECT_FLASH[0] is False
    finally:
        attention.set_direct_flash(False)
