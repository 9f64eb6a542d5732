"""optim.unsharded_accumulation: one data-parallel rank keeps FSDP's compute copy and unsharded
gradients across micro-batches; the step it takes equals the usual one."""

from __future__ import annotations

import torch

from grpo.config import ModelConfig, OptimConfig
from grpo.update import build_optimizer, optimizer_step
from tests.test_nonfinite import mean_nll, text_batch


def _step_weights(tiny_model, hold: bool) -> tuple[dict, float, list]:
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    torch.manual_seed(0)
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(one_device="fsdp"))
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-2))
    batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size), lengths=(12, 9, 11))
    calls = []
    original = policy.model.set_requires_gradient_sync
    policy.model.set_requires_gradient_sync = lambda sync, **kw: (calls.append(sync), original(sync, **kw))[1]
    # max_tokens 12: the three sequences (12, 9 and 11 tokens) go to three micro-batches
    out = optimizer_step(policy, optimizer, batch, mean_nll, max_tokens=12, grad_clip=1.0,
                         denominators={"tokens": 12}, unsharded_accumulation=hold)
    weights = {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
               for n, p in policy.model.named_parameters()}
    return weights, out["loss/grad_norm"], calls


def test_unsharded_accumulation_takes_the_same_step(tiny_model):
    usual, norm_usual, calls_usual = _step_weights(tiny_model, hold=False)
    held, norm_held, calls_held = _step_weights(tiny_model, hold=True)
    # held from the first micro-batch, synced for the last: set twice, not once per micro-batch (each setting
    # walks every submodule)
    assert calls_usual == [] and calls_held == [False, True]
    assert abs(norm_usual - norm_held) < 1e-6 and norm_usual > 0
    for name, w in usual.items():
        torch.testing.assert_close(held[name], w, rtol=0, atol=1e-6, msg=name)


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage Python can reach (a DTensor's local shard; a freed FSDP buffer has none)."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no attribute lookups on proxies
            continue
        try:
            storage = getattr(obj, "_local_tensor", obj).untyped_storage()
            if obj.device.type == "meta" or not storage.size():
                continue
            ptr = storage.data_ptr()
        except RuntimeError:  # a fake tensor another test's compile left behind: no memory of its own
            continue
        if ptr not in seen:
            seen.add(ptr)
            total += storage.size()
    return total


def test_a_held_step_leaves_only_parameters_and_optimizer_state(tiny_model):
    """What the memory plan keeps resident between steps (rollout/colocation.py): after an update that held
    the compute copy and unsharded gradients over two micro-batches, neither is left, nor the sharded
    gradients: the live tensors are the parameters (there before) and the optimizer state."""
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy
    from rollout.colocation import tensor_bytes

    init_distributed()
    torch.manual_seed(0)
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(one_device="fsdp"))
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-2))
    batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
    params = tensor_bytes(policy.model.parameters())
    before = _live_tensor_bytes()
    for hold in (True, True):  # the second step: nothing accumulates from one step to the next
        optimizer_step(policy, optimizer, batch, mean_nll, max_tokens=12, grad_clip=1.0,
                       denominators={"tokens": 8}, unsharded_accumulation=hold)
    state = tensor_bytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert state >= 2 * params
    assert all(p.grad is None for p in policy.model.parameters())
    grown = _live_tensor_bytes() - before
    assert state <= grown < state + 0.05 * params  # a gradient or compute copy would add ~params


def test_the_hold_reaches_every_unit(tiny_model):
    """The hold is set on each FSDP unit the policy finds once, the same units a walk of the model finds."""
    from torch.distributed.fsdp import FSDPModule

    from grpo.update import _Hold
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(one_device="fsdp"))
    walked = [m for m in policy.model.modules() if isinstance(m, FSDPModule)]
    assert policy.fsdp_units == walked and len(walked) > 2 and policy.fsdp_units is policy.fsdp_units
    hold = _Hold(policy)
    for held in (True, False, True, False):
        hold(held)
        for unit in walked:
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is not None:  # a unit without parameters of its own has no group
                assert group.reduce_grads is (not held) and group.reshard_after_backward is (not held)


def test_a_text_only_step_holds_a_tower_no_forward_has_gathered(tiny_model):
    """With model.vision_once a text-only step never runs the vision tower, so FSDP never gathered its unit; the
    hold's no-sync post-backward reads every unit's gathered parameters (FSDP2 raised AttributeError there)."""
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    norms = {}
    for vision_once in ("on", "off"):
        torch.manual_seed(0)
        policy = build_policy(ModelConfig(path=str(tiny_model), dtype="bfloat16", vision_once=vision_once),
                              build_parallel_dims(one_device="fsdp"))
        optimizer = build_optimizer(policy, OptimConfig(lr=1e-2))
        batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size), lengths=(12, 9, 11))
        out = optimizer_step(policy, optimizer, batch, mean_nll, max_tokens=12, grad_clip=1.0,
                             denominators={"tokens": 12}, unsharded_accumulation=True)
        norms[vision_once] = out["loss/grad_norm"]
    assert norms["on"] == norms["off"] and norms["on"] > 0
