"""The varlen attention path on a GPU: packed rows give what sdpa gives per sequence, forward and backward."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the varlen kernel needs CUDA", allow_module_level=True)

from models.attention import _kernel, register  # noqa: E402
from models.packing import pack  # noqa: E402
from tests.test_packing import mixed_batch  # noqa: E402


def _policy(path, attn):
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    register()
    return build_policy(ModelConfig(path=str(path), attn_implementation=attn), build_parallel_dims())


def _grads(policy, mb):
    policy.model.zero_grad(set_to_none=True)
    lp, _ = policy.logprobs(mb)
    lp.sum().backward()
    return lp.detach().float(), torch.cat([p.grad.full_tensor().float().flatten()
                                          for p in policy.model.parameters() if p.grad is not None])


def test_varlen_matches_sdpa(tiny_model):
    _varlen_matches_sdpa(tiny_model)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "glm4v"])
def test_varlen_matches_sdpa_other_towers(family, tmp_path_factory):
    """The towers whose grid inputs are computed on the host and whose windows run in one varlen call
    (FamilyAdapter.varlen_vision), against transformers' own SDPA path."""
    from tools.make_tiny_model import make_tiny_model

    _varlen_matches_sdpa(make_tiny_model(tmp_path_factory.mktemp("models") / family, family=family, size="tiny", seed=0))


def _varlen_matches_sdpa(model_path):
    if _kernel()[0] is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    varlen, sdpa = _policy(model_path, "varlen"), _policy(model_path, "sdpa")
    batch = mixed_batch(varlen.adapter)
    packed = pack(batch, list(range(len(batch))))
    lp_v, g_v = _grads(varlen, packed)
    lp_s, g_s = _grads(sdpa, packed)
    singles = torch.cat([sdpa.logprobs(pack(batch, [i]))[0].detach().float() for i in range(len(batch))])
    noise = float((lp_s - singles).abs().max())  # bf16 kernel noise between two correct sdpa paths
    diff = float((lp_v - singles).abs().max())
    print(f"{varlen.adapter.name}: varlen vs per-sequence sdpa: max |dlogp| {diff:.3e}; sdpa packed vs per-sequence "
          f"{noise:.3e}")
    assert diff <= max(4 * noise, 2e-2)
    rel = float((g_v - g_s).norm() / g_s.norm())
    print(f"gradient relative difference varlen vs sdpa: {rel:.3e}")
    assert rel < 5e-2
