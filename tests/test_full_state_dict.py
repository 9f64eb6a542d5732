"""The policy's full weights (refit, export): on one rank the local shards are the whole tensors, taken without
DTensor's gather; on two ranks gathered (tests/test_grpo_e2e.py refits a two-rank policy into the engine)."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from grpo.config import LoraConfig, ModelConfig
from models.parallel import full_value


def _policy(tiny_model, **kw):
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    torch.manual_seed(0)
    return build_policy(ModelConfig(path=str(tiny_model), **kw), build_parallel_dims(one_device="fsdp"))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_one_rank_takes_the_whole_tensors_without_gathering(tiny_model, monkeypatch, dtype):
    policy = _policy(tiny_model)
    sharded = policy.model.state_dict()
    assert sharded and all(isinstance(t, DTensor) for t in sharded.values())
    gathered = {n: t.full_tensor() for n, t in sharded.items()}  # what DTensor's gather gives
    calls = []
    inner = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: (calls.append(1), inner(self, **kw))[1])
    full = dict(policy.full_state_dict(dtype))
    assert calls == [] and list(full) == list(gathered)
    for name, t in full.items():
        assert not isinstance(t, DTensor) and t.dtype == (dtype or gathered[name].dtype)
        assert torch.equal(t, gathered[name].to(t.dtype)), name


def set_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a parameter's whole value: a DTensor keeps its own shard of it (the same `value` on every rank), a
    plain tensor all of it (tests that change weights by hand, whatever `parallel.one_device` is)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            from torch.distributed.tensor import distribute_tensor

            param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(value)


def test_full_value_of_plain_and_one_device_tensors():
    plain = torch.arange(6.0)
    assert full_value(plain) is plain
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from models.parallel import init_distributed

    init_distributed()
    mesh = init_device_mesh("cpu", (1,))
    for placement in (Shard(0), Shard(1), Replicate()):
        value = torch.arange(12.0).reshape(3, 4)
        t = distribute_tensor(value, mesh, [placement])
        assert torch.equal(full_value(t), value) and full_value(t).shape == (3, 4)


def test_lora_merges_from_the_whole_tensors(tiny_model, monkeypatch):
    from models.lora import lora_modules

    policy = _policy(tiny_model, lora=LoraConfig(rank=4, alpha=8.0))
    adapted = lora_modules(policy.model)
    assert adapted
    with torch.no_grad():  # adapters that change the weight (B starts at zero)
        for module in adapted.values():
            module.lora_B.copy_(distribute_like(module.lora_B, torch.randn(module.lora_B.shape) * 0.1))
    calls = []
    inner = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: (calls.append(1), inner(self, **kw))[1])
    full = dict(policy.full_state_dict())
    assert calls == []
    monkeypatch.undo()
    for owner, module in adapted.items():
        w, a, b = (t.full_tensor() for t in (module.weight, module.lora_A, module.lora_B))
        torch.testing.assert_close(full[f"{owner}.weight"], w + module.scaling * (b @ a), rtol=0, atol=1e-6)
        assert not torch.equal(full[f"{owner}.weight"], w)


def distribute_like(param, value: torch.Tensor) -> torch.Tensor:
    """`value` placed as `param` is (a DTensor's layout)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, param.device_mesh, param.placements) if isinstance(param, DTensor) else value
