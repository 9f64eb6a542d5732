"""Qwen3.5's packed Gated DeltaNet on a GPU: flash-linear-attention's varlen kernel against transformers'
torch rule, forward and backward, at Qwen3.5-4B's heads (16 key / 32 value heads, 128 wide), in float16
(fine enough to see #640's corruption) and bfloat16 (what training runs).

On Hopper with Triton >= 3.4.0 and < 3.7.1 fla refuses this backward (fla-org/flash-linear-attention#640);
`models.fla_guard` lifts that guard for 128-wide key heads after a self-check on the device, as the
trainer does before its first backward. The module's fixture makes that decision and prints it (run
with -s to see the self-check's errors); the tests then compare gradients on packed rows."""

import dataclasses
import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the varlen delta rule needs CUDA", allow_module_level=True)
if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention (fla-core) is not installed", allow_module_level=True)

from models import fla_guard  # noqa: E402
from models.families.qwen3_5 import (  # noqa: E402
    _heads_as_values, _position_in_sequence, _torch_rule, fla_delta_rule_packed, gated_norm, packed_conv,
    restarting_causal_conv, torch_delta_rule_packed)

SHAPE_4B = fla_guard.RuleShape(k_heads=16, v_heads=32, k_dim=128, v_dim=128, dtype=torch.bfloat16)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", autouse=True)
def plan():
    """This device's route for fla's gated backward (the self-check runs here where the guard is lifted)."""
    chosen = fla_guard.prepare_backward(_device(), SHAPE_4B, fla_delta_rule_packed, torch_delta_rule_packed)
    print(f"\n{torch.cuda.get_device_name()}: {fla_guard.read_flags()}; route {chosen.route}; "
          f"self-check errors {chosen.errors}", flush=True)
    return chosen


def _per_sequence_rule(q, k, v, g, beta, cu):
    """transformers' rule on each sequence of the packed row alone, the outputs joined again (key heads
    repeated over their value heads first, as the layer does: transformers 5.17's rule takes them so)."""
    q, k = _heads_as_values(q, k, v)
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out, _ = _torch_rule()(*(t[:, start:end] for t in (q, k, v)), g=g[:, start:end], beta=beta[:, start:end],
                               use_qk_l2norm_in_kernel=True)
        outs.append(out)
    return torch.cat(outs, dim=1)


def _assert_within_tolerance(errors, dtype, label):
    print(f"\n{label}, {dtype}, relative errors {errors}", flush=True)
    for name, error in errors.items():
        assert error <= fla_guard.tolerance(name, dtype), (name, errors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fla_varlen_equals_torch_rule_per_sequence(dtype):
    """fla on a packed row against transformers' rule on each sequence alone (fp32): output and every
    input's gradient, within the self-check's tolerances."""
    errors = fla_guard.gradient_errors(fla_delta_rule_packed, _per_sequence_rule,
                                       dataclasses.replace(SHAPE_4B, dtype=dtype), _device(),
                                       lengths=(37, 5, 190, 64, 1))
    _assert_within_tolerance(errors, dtype, "per-sequence reference")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_self_check_on_other_lengths(plan, dtype):
    """The self-check's comparison on a second packed row (a long sequence first, short ones after)."""
    errors = fla_guard.gradient_errors(fla_delta_rule_packed, torch_delta_rule_packed,
                                       dataclasses.replace(SHAPE_4B, dtype=dtype), _device(),
                                       lengths=(300, 7, 128, 65))
    _assert_within_tolerance(errors, dtype, f"route {plan.route}")


def test_block_64_is_refused_where_fla_guards(plan):
    """Where fla's guard fires (and tilelang does not replace the kernel), 64-wide key heads are refused
    before any backward, with the remedy in the message."""
    if plan.route != "lifted":
        pytest.skip(f"fla's guard is not lifted here (route {plan.route})")
    index = torch.cuda.current_device()
    with pytest.raises(fla_guard.DeltaRuleBackwardError, match="a block of 64.*Triton to >= 3.7.1"):
        fla_guard.plan_route(fla_guard.read_flags(), 64, fla_guard._hopper_tiling(index), False, True)


def _relative_errors(ours, ref, names):
    return {name: ((a - b).norm() / b.norm().clamp_min(1e-12)).item() for name, a, b in zip(names, ours, ref)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_convolution_equals_the_restarting_one(dtype):
    """The packed row's convolution and SiLU through fla's varlen kernel against the torch path (which a CPU
    test checks against each sequence alone): output and the gradients of input, weight and bias, at
    Qwen3.5-4B's 8,192 channels and width 4, with a 1-token sequence among others."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    device, lengths = _device(), (37, 5, 190, 64, 1, 300)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    channels, width = 8192, 4
    x = torch.randn(sum(lengths), channels, device=device, dtype=dtype).t().requires_grad_()  # (C, L) view
    weight = (torch.randn(channels, width, device=device, dtype=dtype) / 2).requires_grad_()
    bias = (torch.randn(channels, device=device, dtype=dtype) / 10).requires_grad_()
    grad = torch.randn(channels, sum(lengths), device=device, dtype=dtype)

    def run(fn):
        for t in (x, weight, bias):
            t.grad = None
        out = fn()
        out.backward(grad)
        return [out.detach().float()] + [t.grad.float() for t in (x, weight, bias)]

    ours = run(lambda: packed_conv(x, weight, bias, "silu", cu))
    ref = run(lambda: ACT2FN["silu"](restarting_causal_conv(x, weight, bias,
                                                            _position_in_sequence(cu, x.shape[1]))))
    errors = _relative_errors(ours, ref, ("out", "dx", "dweight", "dbias"))
    print(f"\nconvolution {dtype}: relative errors {errors}", flush=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert all(e <= tol for e in errors.values()), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_gated_norm_equals_the_layers_own(dtype):
    """The Gated DeltaNet's gated RMSNorm through fla's fused kernel against transformers' module: output and
    the gradients of input, gate and weight, at Qwen3.5-4B's 32 value heads of 128 over 3,000 tokens."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    torch.manual_seed(0)
    device = _device()
    norm = Qwen3_5RMSNormGated(128, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(torch.randn_like(norm.weight) / 4)
    x = torch.randn(3000 * 32, 128, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(3000 * 32, 128, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(3000 * 32, 128, device=device, dtype=dtype)

    def run(fn):
        for t in (x, gate, norm.weight):
            t.grad = None
        out = fn()
        assert out.dtype == dtype
        out.backward(grad)
        return [out.detach().float()] + [t.grad.float() for t in (x, gate, norm.weight)]

    errors = _relative_errors(run(lambda: gated_norm(norm, x, gate)), run(lambda: norm(x, gate)),
                              ("out", "dx", "dgate", "dweight"))
    print(f"\ngated norm {dtype}: relative errors {errors}", flush=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert all(e <= tol for e in errors.values()), errors
