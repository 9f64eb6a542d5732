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
from models.families.qwen3_5 import _torch_rule, fla_delta_rule_packed, torch_delta_rule_packed  # noqa: E402

SHAPE_4B = fla_guard.RuleShape(k_heads=16, v_heads=32, k_dim=128, v_dim=128, dtype=torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def plan():
    """This device's route for fla's gated backward (the self-check runs here where the guard is lifted)."""
    device = torch.device("cuda", torch.cuda.current_device())
    chosen = fla_guard.prepare_backward(device, SHAPE_4B, fla_delta_rule_packed, torch_delta_rule_packed)
    print(f"\n{torch.cuda.get_device_name()}: {fla_guard.read_flags()}; route {chosen.route}; "
          f"self-check errors {chosen.errors}", flush=True)
    return chosen


def _inputs(lengths, shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    make = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k = make(1, total, shape.k_heads, shape.k_dim), make(1, total, shape.k_heads, shape.k_dim)
    v = make(1, total, shape.v_heads, shape.v_dim)
    gate = torch.nn.functional.logsigmoid(make(1, total, shape.v_heads))  # log decay < 0, fp32 as the layer has it
    beta = torch.rand(1, total, shape.v_heads, generator=g, device="cuda")
    q, k, v, beta = (t.to(shape.dtype) for t in (q, k, v, beta))
    return [q, k, v, gate, beta]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fla_varlen_equals_torch_rule_per_sequence(dtype):
    """fla on a packed row against transformers' rule on each sequence alone (fp32): output and every
    input's gradient, within the self-check's tolerances."""
    lengths = [37, 5, 190, 64, 1]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    shape = dataclasses.replace(SHAPE_4B, dtype=dtype)
    values = _inputs(lengths, shape)
    grad_out = torch.randn(1, sum(lengths), shape.v_heads, shape.v_dim, device="cuda")
    leaves = [t.clone().requires_grad_() for t in values]
    packed = fla_delta_rule_packed(*leaves, cu)
    got = [packed, *torch.autograd.grad(packed, leaves, grad_out.to(packed.dtype))]
    exact = [t.float().requires_grad_() for t in values]
    outs = []
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i]) + n)
        out, _ = _torch_rule()(*(t[:, sl] for t in exact[:3]), g=exact[3][:, sl], beta=exact[4][:, sl],
                               use_qk_l2norm_in_kernel=True)
        outs.append(out)
    reference = torch.cat(outs, dim=1)
    want = [reference, *torch.autograd.grad(reference, exact, grad_out)]
    errors = {name: fla_guard.relative_error(a, b) for name, a, b in zip(("out", *fla_guard.GRADIENTS), got, want)}
    print(f"\nper-sequence reference, {dtype}, relative errors {errors}", flush=True)
    for name, error in errors.items():
        assert error <= fla_guard.tolerance(name, dtype), (name, errors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_self_check_on_other_lengths(plan, dtype):
    """The self-check's comparison on a second packed row (a long sequence first, short ones after)."""
    errors = fla_guard.gradient_errors(fla_delta_rule_packed, torch_delta_rule_packed,
                                       dataclasses.replace(SHAPE_4B, dtype=dtype),
                                       torch.device("cuda", torch.cuda.current_device()), lengths=(300, 7, 128, 65))
    print(f"\nroute {plan.route}, {dtype}, relative errors {errors}", flush=True)
    for name, error in errors.items():
        assert error <= fla_guard.tolerance(name, dtype), (name, errors)


def test_block_64_is_refused_where_fla_guards(plan):
    """Where fla's guard fires (and tilelang does not replace the kernel), 64-wide key heads are refused
    before any backward, with the remedy in the message."""
    if plan.route != "lifted":
        pytest.skip(f"fla's guard is not lifted here (route {plan.route})")
    index = torch.cuda.current_device()
    with pytest.raises(fla_guard.DeltaRuleBackwardError, match="a block of 64.*Triton to >= 3.7.1"):
        fla_guard.plan_route(fla_guard.read_flags(), 64, fla_guard._hopper_tiling(index), False, True)
