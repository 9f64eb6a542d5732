"""Optimizer state offload: moments always move; the step counter moves only where AdamW keeps it beside
the params."""

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
