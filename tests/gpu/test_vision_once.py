"""model.vision_once on the GPU (bf16 compute over fp32 weights, FSDP's mixed precision): the pass's tower calls and
the tower's one backward give the per-micro-batch pass's logprobs and gradients up to bf16 rounding, the tower's
own gradients included; model.pad_vision_mlp likewise. Skipped without CUDA."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("model.vision_once's default and its bf16 path are the GPU's", allow_module_level=True)

from tests.test_vision_once import _step, _tower_calls, batch, policy  # noqa: E402,F401  (fixtures)


def _close(grads, reference, tower: set[str]) -> None:
    assert grads.keys() == reference.keys() and any(n.endswith(t) for n in grads for t in tower)
    for name in reference:
        rel = (grads[name].float() - reference[name].float()).norm() / reference[name].float().norm().clamp_min(1e-12)
        assert rel < 0.05, (name, float(rel))


def test_vision_once_matches_the_per_microbatch_pass_in_bf16(policy, batch):  # noqa: F811
    assert policy.device.type == "cuda" and policy.dtype == torch.bfloat16
    calls = _tower_calls(policy)
    step, _, grads, _, _ = _step(policy, batch, 160, False, calls)
    step_once, _, grads_once, calls_update, _ = _step(policy, batch, 160, True, calls)
    d = torch.cat([(a - b).abs() for a, b in zip(step.per_sample("lp"), step_once.per_sample("lp"))])
    print(f"vision_once vs per micro-batch: max |dlogprob| {d.max():.3e}, mean {d.mean():.3e} over {d.numel()} "
          f"tokens; {calls_update} tower calls in the update")
    assert d.max() < 0.05 and d.mean() < 5e-3 and calls_update == 2
    _close(grads_once, grads, {n for n, _ in policy.adapter.vision_tower(policy.model).named_parameters()})


def test_padded_vision_mlp_matches_in_bf16(tiny_model, batch):  # noqa: F811
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    runs = []
    for pad in (False, True):
        torch.manual_seed(0)
        padded = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on",
                                          pad_vision_mlp=pad), build_parallel_dims())
        step, _, grads, _, _ = _step(padded, batch, 160, True, [])
        runs.append((step.per_sample("lp"), grads, padded))
    (lp, grads, plain), (lp_padded, grads_padded, _) = runs
    d = torch.cat([(a - b).abs() for a, b in zip(lp, lp_padded)])
    print(f"padded vision MLP: max |dlogprob| {d.max():.3e}")
    assert d.max() < 0.05
    _close(grads_padded, grads, {n for n, _ in plain.adapter.vision_tower(plain.model).named_parameters()})


def test_torch_rms_norm_matches_the_modules_in_bf16(tiny_model, batch):  # noqa: F811
    """model.torch_rms_norm on CUDA: torch's fused kernel runs (the norms' weights and inputs both bf16 under FSDP's
    mixed precision, so no call falls back) and the logprobs and gradients are the modules' up to bf16 rounding."""
    from grpo.config import ModelConfig
    from models.parallel import build_parallel_dims
    from models.policy import build_policy

    runs = []
    for routed in (False, True):
        torch.manual_seed(0)
        policy = build_policy(ModelConfig(path=str(tiny_model), shared_prompts=True, vision_once="on",
                                          liger_kernel="false", torch_rms_norm=routed), build_parallel_dims())
        fused = []
        handle = torch.nn.functional.rms_norm
        torch.nn.functional.rms_norm = lambda *a, **k: fused.append(a[0].dtype) or handle(*a, **k)
        try:
            step, _, grads, _, _ = _step(policy, batch, 160, True, [])
        finally:
            torch.nn.functional.rms_norm = handle
        runs.append((step.per_sample("lp"), grads, policy, fused))
    (lp, grads, plain, none), (lp_routed, grads_routed, routed_policy, fused) = runs
    assert not none and fused and set(fused) == {torch.bfloat16} and routed_policy.torch_rms_norms > 0
    d = torch.cat([(a - b).abs() for a, b in zip(lp, lp_routed)])
    print(f"torch's RMSNorm: max |dlogprob| {d.max():.3e}, mean {d.mean():.3e}; {len(fused)} fused calls")
    assert d.max() < 0.05
    _close(grads_routed, grads, {n for n, _ in plain.adapter.vision_tower(plain.model).named_parameters()})
