"""A non-finite loss or gradient skips the optimizer step: weights and optimizer state stay bitwise equal."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from data.batch import Batch
from grpo.config import ModelConfig, OptimConfig
from grpo.update import build_optimizer, optimizer_step
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy


@pytest.fixture(scope="module")
def setup(tiny_model):
    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-2))
    batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
    # one good step first, so the Adam moments and step counter exist and could be disturbed
    out = step(policy, optimizer, batch, mean_nll)
    assert out["loss/skipped_nonfinite"] == 0.0
    return policy, optimizer, batch


def text_batch(policy, vocab: int, lengths: tuple[int, ...] = (12, 9)) -> Batch:
    """Text-only sequences (two by default); the last 4 tokens of each are scored."""
    gen = torch.Generator().manual_seed(0)
    ids, masks, pos = [], [], []
    for length in lengths:
        seq = torch.randint(10, min(vocab, 200), (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.long)
        mask[-4:] = 1
        ids.append(seq)
        masks.append(mask)
        pos.append(policy.adapter.position_ids(seq, None))
    none = [None] * len(lengths)
    batch = Batch({"input_ids": ids, "loss_mask": masks, "pixel_values": none, "image_grid_thw": list(none)})
    batch["position_ids"] = pos
    return batch


def mean_nll(lp, mb, den):
    return -lp.sum() / den["tokens"], {}


def step(policy, optimizer, batch, loss_fn) -> dict:
    return optimizer_step(policy, optimizer, batch, loss_fn, max_tokens=64, grad_clip=1.0,
                          denominators={"tokens": 8.0})


def snapshot(policy, optimizer) -> dict[str, torch.Tensor]:
    """Every local weight shard and every optimizer state tensor, cloned."""
    out = {}
    for name, p in policy.model.named_parameters():
        out[f"w:{name}"] = (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
    for i, (p, state) in enumerate(optimizer.state.items()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"opt:{i}:{key}"] = (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
    return out


def changed(before: dict, after: dict) -> list[str]:
    assert before.keys() == after.keys()
    return [k for k in before if not torch.equal(before[k], after[k])]


def nan_loss(lp, mb, den):
    return lp.sum() * float("nan"), {}


def inf_gradient(lp, mb, den):
    """A finite loss whose backward carries an infinite gradient into every parameter."""
    lp.register_hook(lambda g: torch.full_like(g, float("inf")))
    return -lp.sum() / den["tokens"], {}


@pytest.mark.parametrize("loss_fn", [nan_loss, inf_gradient], ids=["nan_loss", "inf_gradient"])
def test_nonfinite_step_is_skipped_and_changes_nothing(setup, loss_fn):
    policy, optimizer, batch = setup
    before = snapshot(policy, optimizer)
    assert any(k.startswith("opt:") and k.endswith(":exp_avg") for k in before)
    out = step(policy, optimizer, batch, loss_fn)
    assert out["loss/skipped_nonfinite"] == 1.0
    if loss_fn is inf_gradient:
        assert math.isfinite(out["loss/total"]) and not math.isfinite(out["loss/grad_norm"])
    else:
        assert math.isnan(out["loss/total"])
    assert changed(before, snapshot(policy, optimizer)) == []
    assert all(p.grad is None for p in policy.model.parameters()), "non-finite gradients were left behind"


def test_finite_step_changes_weights_and_state(setup):
    policy, optimizer, batch = setup
    before = snapshot(policy, optimizer)
    out = step(policy, optimizer, batch, mean_nll)
    assert out["loss/skipped_nonfinite"] == 0.0 and math.isfinite(out["loss/grad_norm"])
    moved = changed(before, snapshot(policy, optimizer))
    assert any(k.startswith("w:") for k in moved) and any(k.endswith(":step") for k in moved)
    assert any(k.endswith(":exp_avg_sq") for k in moved)
