"""optim.allocate_state_at_start: AdamW's state made when the optimizer is built, with the numbers of the
lazily made state: the same parameters, moments and step counts after every step, sharded policy included."""

import types

import torch
from torch import nn

from grpo.config import ModelConfig, OptimConfig, load_config
from grpo.update import allocate_state, build_optimizer


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    second = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    second.load_state_dict(first.state_dict())
    return first, second


def _as_policy(model):
    return types.SimpleNamespace(model=model, device=torch.device("cpu"))


def _step(model, opt, x, lr):
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def test_state_at_start_equals_the_lazy_state_step_by_step():
    eager_model, lazy_model = _pair()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    eager = build_optimizer(_as_policy(eager_model), OptimConfig(lr=1e-2, weight_decay=0.1, allocate_state_at_start=True))
    lazy = build_optimizer(_as_policy(lazy_model), cfg)
    assert not lazy.state and len(eager.state) == 4
    for p in eager_model.parameters():
        state = eager.state[p]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert p.grad is None
    assert all(g["lr"] == 1e-2 for g in eager.param_groups)
    # the parameters did not move
    for a, b in zip(eager_model.parameters(), lazy_model.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(1)
    for step, lr in enumerate([1e-2, 5e-3, 2e-2], start=1):
        x = torch.randn(4, 6)
        _step(eager_model, eager, x, lr)
        _step(lazy_model, lazy, x, lr)
        for a, b in zip(eager_model.parameters(), lazy_model.parameters()):
            assert torch.equal(a, b), step
            sa, sb = eager.state[a], lazy.state[b]
            assert float(sa["step"]) == float(sb["step"]) == step
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_allocate_state_leaves_a_used_optimizer_alone():
    model, _ = _pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, torch.randn(2, 6), 1e-2)
    steps = {id(p): float(opt.state[p]["step"]) for p in model.parameters()}
    allocate_state(opt)
    assert {id(p): float(opt.state[p]["step"]) for p in model.parameters()} == steps


def test_config_default():
    assert load_config(None, []).optim.allocate_state_at_start is False
    assert load_config(None, ["optim.allocate_state_at_start=true"]).optim.allocate_state_at_start is True


def test_a_sharded_policy_trains_the_same_with_state_at_start(tiny_model):
    """The FSDP-wrapped policy (DTensor parameters): two optimizer steps from the same weights give the same
    weights, with the state made at start or by the first step."""
    from grpo.update import optimizer_step
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_nonfinite import mean_nll, text_batch

    init_distributed()
    results = []
    for at_start in (True, False):
        torch.manual_seed(0)
        policy = build_policy(ModelConfig(path=str(tiny_model), dtype="float32", attn_implementation="sdpa"),
                              build_parallel_dims())
        opt = build_optimizer(policy, OptimConfig(lr=1e-2, weight_decay=0.01, allocate_state_at_start=at_start))
        assert bool(opt.state) is at_start
        batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
        for _ in range(2):
            optimizer_step(policy, opt, batch, mean_nll, max_tokens=12, grad_clip=1.0, denominators={"tokens": 8})
        results.append({n: t.clone() for n, t in policy.full_state_dict()})
    eager, lazy = results
    assert eager.keys() == lazy.keys()
    assert all(torch.equal(eager[n], lazy[n]) for n in eager)


def test_a_checkpoint_loads_into_state_made_at_start(tiny_model, tmp_path):
    """Resuming: a checkpoint saved after two steps, loaded into an optimizer whose state was made at start,
    holds the saved step counts and moments, and the next step moves the weights as one resumed into lazily
    made state does."""
    from grpo.checkpoint import load_checkpoint, save_checkpoint
    from grpo.update import optimizer_step
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from tests.test_nonfinite import mean_nll, text_batch

    init_distributed()
    cfg = ModelConfig(path=str(tiny_model), dtype="float32", attn_implementation="sdpa")

    def one_step(policy, opt):
        batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
        optimizer_step(policy, opt, batch, mean_nll, max_tokens=12, grad_clip=1.0, denominators={"tokens": 8})

    torch.manual_seed(0)
    policy = build_policy(cfg, build_parallel_dims())
    opt = build_optimizer(policy, OptimConfig(lr=1e-2))
    for _ in range(2):
        one_step(policy, opt)
    folder = save_checkpoint(tmp_path / "run", 2, policy.model, opt, {"data": {}}, str(tiny_model))
    results = []
    for at_start in (True, False):
        torch.manual_seed(1)  # other initial weights: the checkpoint must bring back the saved ones
        resumed = build_policy(cfg, build_parallel_dims())
        resumed_opt = build_optimizer(resumed, OptimConfig(lr=1e-2, allocate_state_at_start=at_start))
        load_checkpoint(folder, resumed.model, resumed_opt)
        steps = {float(s["step"]) for s in resumed_opt.state.values()}
        assert steps == {2.0}
        one_step(resumed, resumed_opt)
        results.append({n: t.clone() for n, t in resumed.full_state_dict()})
    eager, lazy = results
    assert all(torch.equal(eager[n], lazy[n]) for n in eager)
