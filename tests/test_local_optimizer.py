"""The clip and AdamW on one device: computed on the local tensors of the policy's DTensors, the same numbers as
torch's own over the DTensors (fp32, CPU), with no DTensor reaching AdamW's update."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from grpo.config import ModelConfig, OptimConfig
from grpo.update import AdamW, build_optimizer, clip_gradients


def _policy(tiny_model):
    from models.parallel import build_parallel_dims, init_distributed
    from models.policy import build_policy

    init_distributed()
    torch.manual_seed(0)
    return build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(one_device="fsdp"))


def _set_grads(params, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        local = torch.randn(p.to_local().shape, generator=g) * scale
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _snapshot(params) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in params]


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
def test_clip_gradients_is_torchs_clip(tiny_model, max_norm):
    params = [p for p in _policy(tiny_model).model.parameters()]
    assert all(isinstance(p, DTensor) for p in params)
    _set_grads(params, 0)
    theirs_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).full_tensor()
    theirs = [p.grad.to_local().clone() for p in params]
    _set_grads(params, 0)
    ours_norm = clip_gradients(params, max_norm)
    assert not isinstance(ours_norm, DTensor) and torch.equal(ours_norm, theirs_norm) and ours_norm > 1
    for p, t in zip(params, theirs):
        assert torch.equal(p.grad.to_local(), t)
    if max_norm < 1:  # clipped: the scaled gradients' norm is max_norm
        assert torch.nn.utils.get_total_norm([p.grad.to_local() for p in params]) == pytest.approx(max_norm, rel=1e-4)


def test_adamw_on_local_tensors_is_torchs_adamw(tiny_model, monkeypatch):
    """Two steps from the same weights and gradients: every weight and moment bitwise equal to torch's AdamW's;
    the update itself is handed plain tensors, and the state stays DTensors keyed by the parameters."""
    import torch.optim.adam as adam_module

    results = []
    for ours in (False, True):
        policy = _policy(tiny_model)
        params = [p for p in policy.model.parameters() if p.requires_grad]
        kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        optimizer = AdamW(params, **kwargs) if ours else torch.optim.AdamW(params, **kwargs)
        seen = []
        inner = adam_module.adam
        monkeypatch.setattr(adam_module, "adam", lambda *a, **kw: (seen.append(a), inner(*a, **kw))[1])
        for step in range(2):
            _set_grads(params, step)
            optimizer.step()
        monkeypatch.undo()
        handed = [t for lists in seen for each in lists if isinstance(each, list) for t in each]
        assert handed and any(isinstance(t, DTensor) for t in handed) != ours
        state = optimizer.state[params[0]]
        assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)
        results.append((_snapshot(params), [optimizer.state[p][k].to_local().clone() for p in params
                                            for k in ("exp_avg", "exp_avg_sq")]))
    (w_torch, m_torch), (w_ours, m_ours) = results
    assert any(not torch.equal(a, b) for a, b in zip(w_ours, _snapshot(
        [p for p in _policy(tiny_model).model.parameters() if p.requires_grad])))  # the steps moved the weights
    for a, b in zip(w_ours + m_ours, w_torch + m_torch):
        assert torch.equal(a, b)


def test_the_trainer_builds_the_local_adamw(tiny_model):
    optimizer = build_optimizer(_policy(tiny_model), OptimConfig(lr=1e-3))
    assert isinstance(optimizer, AdamW) and isinstance(optimizer, torch.optim.AdamW)


def test_the_cost_tool_times_both_sides():
    from tools.host_cost import measure

    out = measure(params=20, numel=8, repeats=2)
    for key in ("clip_torch_ms", "clip_local_ms", "adamw_torch_ms", "adamw_local_ms"):
        assert out[key] > 0, key


def test_the_cost_tool_runs_every_part(tmp_path, capsys):
    import json

    from tools.host_cost import main

    assert main(["--parts", "refit,gc,pack,ref,train", "--repeats", "1", "--ref-seqs", "4", "--ref-len", "16",
                 "--workdir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["refit_tensors"] > 0 and out["fsdp_units"] > 2 and out["gc_objects"] > out["gc_objects_frozen"]
    assert out["pack_sequences"] == 128 and out["prompt_groups_ms"] > 0
    assert out["ref_units"] > 2 and out["ref_microbatches"] == 2 and out["ref_fp32_equal"] and out["ref_bf16_equal"]
    assert out["train_microbatches"] == 2 and out["train_fp32_equal"] and out["train_bf16_equal"]
