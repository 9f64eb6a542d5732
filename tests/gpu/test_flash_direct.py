"""model.flash_direct on a GPU: `FlashVarlen` (torch's FlashAttention varlen ops called directly, grouped K/V heads
read by the kernel) against `varlen_attn` with K/V repeated, bf16: the same outputs and gradients up to the
order the grouped heads' gradients are summed in; and a tiny model's update and logprobs with it on and off."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FlashAttention's varlen ops need CUDA", allow_module_level=True)

from models import attention  # noqa: E402
from models.attention import _run_kernel  # noqa: E402
from tests.test_vision_once import _step, batch, policy  # noqa: E402,F401  (fixtures)


@pytest.mark.parametrize("heads, kv_heads, causal", [(16, 2, True), (16, 16, False)])
def test_direct_calls_match_varlen_attn(heads, kv_heads, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 700, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, 700, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 300, 301, 700], dtype=torch.int32, device="cuda")
    runs = []
    for direct in (False, True):
        attention.set_direct_flash(direct)
        try:
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = _run_kernel(*inputs, cu, 399, None, causal=causal)
            out.backward(torch.ones_like(out))
            runs.append((out.detach(), [t.grad for t in inputs]))
        finally:
            attention.set_direct_flash(False)
    (out, grads), (out_direct, grads_direct) = runs
    print(f"heads {heads}/{kv_heads}: max |out diff| {(out - out_direct).abs().max():.3e}, max |dk diff| "
          f"{(grads[1] - grads_direct[1]).abs().max():.3e}")
    torch.testing.assert_close(out_direct, out, atol=1e-2, rtol=1e-2)
    for a, b in zip(grads_direct, grads):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


def test_a_tiny_model_step_matches_with_direct_calls(policy, batch):  # noqa: F811
    runs = []
    for direct in (False, True):
        attention.set_direct_flash(direct)
        try:
            step, _, grads, _, _ = _step(policy, batch, 160, True, [])
        finally:
            attention.set_direct_flash(False)
        runs.append((step.per_sample("lp"), grads))
    (lp, grads), (lp_direct, grads_direct) = runs
    d = torch.cat([(a - b).abs() for a, b in zip(lp, lp_direct)])
    print(f"flash_direct: max |dlogprob| {d.max():.3e}, mean {d.mean():.3e}")
    assert d.max() < 0.05
    for name in grads:
        rel = (grads_direct[name].float() - grads[name].float()).norm() / grads[name].float().norm().clamp_min(1e-12)
        assert rel < 0.05, (name, float(rel))
