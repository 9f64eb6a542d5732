"""Optimizer state offload: moments always move; the step counter moves only where AdamW keeps it beside
the params. When the policy must leave the GPU during generation at all."""

import pytest
import torch

from models.policy import move_optimizer_state


@pytest.mark.parametrize("fused", [True, False])
def test_step_counter_follows_fused_adamw(fused):
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=fused)
    p.grad = torch.ones(4)
    opt.step()
    target = torch.device("meta")  # a second device on any machine
    move_optimizer_state(opt, target)
    state = opt.state[p]
    assert state["exp_avg"].device == target and state["exp_avg_sq"].device == target
    assert state["step"].device == (target if fused else torch.device("cpu"))


def test_offload_needed_only_when_policy_and_engine_do_not_fit():
    from grpo.trainer import OFFLOAD_HEADROOM, offload_needed

    gib = 2**30
    device = 140 * gib
    # a 4B-parameter fp32 policy (16 GiB, 48 GiB with AdamW) beside a vLLM engine at 0.35: fits
    assert not offload_needed(16 * gib, 0, int(0.35 * device), device)
    # the same beside an engine at 0.7 of the device: does not
    assert offload_needed(16 * gib, 0, int(0.7 * device), device)
    # a reference model tips the balance
    budget = OFFLOAD_HEADROOM * device
    params = int((budget - 49 * gib) / 3) - gib
    assert not offload_needed(params, 0, 49 * gib, device)
    assert offload_needed(params, 4 * gib, 49 * gib, device)
