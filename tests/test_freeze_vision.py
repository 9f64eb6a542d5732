"""model.freeze_vision_tower: the vision tower keeps its weights through an update (no gradients, no optimizer
state) while the language model trains; the config refuses LoRA adapters inside a frozen tower."""

import pytest
import torch

from grpo.config import ConfigError, ModelConfig, OptimConfig, load_config
from grpo.update import build_optimizer
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy


def _update(path: str, freeze: bool):
    from tests.test_lora import sequences

    init_distributed()
    policy = build_policy(ModelConfig(path=path, dtype="float32", attn_implementation="sdpa",
                                      freeze_vision_tower=freeze), build_parallel_dims())
    before = {n: t.clone() for n, t in policy.full_state_dict()}
    opt = build_optimizer(policy, OptimConfig(lr=1e-2))
    lp, _ = policy.logprobs(sequences(policy.adapter))
    (-lp.mean()).backward()
    opt.step()
    return policy, opt, before, {n: t.clone() for n, t in policy.full_state_dict()}


def test_a_frozen_tower_keeps_its_weights_while_the_decoder_trains(tiny_model):
    policy, opt, before, after = _update(str(tiny_model), True)
    tower = {id(p) for p in policy.adapter.vision_tower(policy.model).parameters()}
    assert tower and all(not p.requires_grad and p.grad is None
                         for p in policy.model.parameters() if id(p) in tower)
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    assert in_optimizer and not in_optimizer & tower
    visual = [n for n in before if n.startswith("model.visual.")]
    assert visual and all(torch.equal(before[n], after[n]) for n in visual)
    decoder = [n for n in before if ".layers." in n and "visual" not in n]
    assert any(not torch.equal(before[n], after[n]) for n in decoder)
    # without the key the same update moves the tower
    _, _, before, after = _update(str(tiny_model), False)
    assert any(not torch.equal(before[n], after[n]) for n in visual)


def test_config_default_and_lora_in_a_frozen_tower():
    assert load_config(None, []).model.freeze_vision_tower is False
    assert load_config(None, ["model.freeze_vision_tower=true"]).model.freeze_vision_tower is True
    with pytest.raises(ConfigError, match="'model.lora.vision_targets' and 'model.freeze_vision_tower'"):
        load_config(None, ["model.freeze_vision_tower=true", "model.lora.rank=4", "model.lora.vision_targets=[qkv]"])


def test_a_frozen_tower_under_unsharded_accumulation(tiny_model):
    """The held-gradient step (optim.unsharded_accumulation, two micro-batches) takes a frozen tower's
    missing gradients in its stride."""
    from grpo.update import optimizer_step
    from tests.test_nonfinite import mean_nll, text_batch

    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model), freeze_vision_tower=True), build_parallel_dims())
    before = {n: t.clone() for n, t in policy.full_state_dict()}
    opt = build_optimizer(policy, OptimConfig(lr=1e-2))
    batch = text_batch(policy, vocab=int(policy.model.config.get_text_config().vocab_size))
    out = optimizer_step(policy, opt, batch, mean_nll, max_tokens=12, grad_clip=1.0, denominators={"tokens": 8},
                         unsharded_accumulation=True)
    after = dict(policy.full_state_dict())
    assert out["loss/grad_norm"] > 0
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith("model.visual."))
    assert any(not torch.equal(before[n], after[n]) for n in before if ".layers." in n and "visual" not in n)
