"""The lm_head's logprobs in one autograd node (models.logits.head_logprobs) on a GPU, at the 3B model's vocabulary:
the fp32-output product of bf16 operands as the chunk-by-chunk path computes it (the same forward bits and the
same hidden-state gradient), the weight gradient summed inside the product (close to the chunks' sum)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the fp32-output product of bf16 operands needs CUDA", allow_module_level=True)

from tests.test_head_logprobs import _chunked, _fused, _grads  # noqa: E402


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_matches_the_chunked_path_on_cuda(temperature):
    torch.manual_seed(0)
    head = torch.nn.Linear(2048, 151936, bias=False, device="cuda", dtype=torch.bfloat16)
    rows = 2500  # two full 1,024-row chunks and a partial one (test_head_logprobs' CHUNK is 16: many chunks)
    h = torch.randn(rows, 2048, device="cuda").mul(2).to(torch.bfloat16)
    targets = torch.randint(0, 151936, (rows,), device="cuda")
    upstream = torch.randn(rows, device="cuda")
    lp, ent, gh, gw = _grads(_fused, head, h, targets, upstream, temperature, True, True)
    ref_lp, ref_ent, ref_gh, ref_gw = _grads(_chunked, head, h, targets, upstream, temperature, True, True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    assert torch.equal(gh, ref_gh)
    err = (gw.float() - ref_gw.float()).abs().max().item()
    scale = ref_gw.float().abs().max().item()
    print(f"T={temperature}: max |dgrad_W| {err:.3g} of max |grad_W| {scale:.3g}")
    assert err <= 2e-2 * scale
