"""model.shared_prompts on the GPU: the varlen kernel over a shared-prompt row (each response's queries over
its prompt's keys and its own, the causal mask aligned to the last key) gives the unshared row's logprobs up
to bf16 rounding, and gradients as close. A mask aligned to the first key instead would let a response's
first token see only the prompt's first token: logprobs off by far more. Skipped without CUDA."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the varlen kernel needs CUDA", allow_module_level=True)

from tests.test_shared_prompts import _logprobs_and_grads, batch, policy  # noqa: E402,F401  (fixtures)


def test_the_kernel_reads_a_shared_row_as_the_sequences_apart(policy, batch):  # noqa: F811
    from models.attention import kernel_available

    assert kernel_available() and policy.device.type == "cuda"
    lp_plain, g_plain, tokens_plain, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=False)
    lp_shared, g_shared, tokens_shared, _ = _logprobs_and_grads(policy, batch, 1 << 20, share=True)
    d = torch.cat([(a - b).abs() for a, b in zip(lp_plain, lp_shared)])
    print(f"shared vs unshared: max |dlogprob| {d.max():.3e}, mean {d.mean():.3e} over {d.numel()} tokens; "
          f"row tokens {tokens_shared} against {tokens_plain}")
    assert d.max() < 0.05 and d.mean() < 5e-3
    for name in g_plain:
        rel = (g_shared[name].float() - g_plain[name].float()).norm() / g_plain[name].float().norm().clamp_min(1e-12)
        assert rel < 0.1, (name, float(rel))
