"""LoRA through the trainer on the tiny Qwen2.5-VL: one GRPO step and one SFT step in this process (one
rank), and one FSDP2 update over two gloo ranks that matches the same update on one rank."""

import json

import pytest
import torch
import torch.distributed as dist

import grpo.trainer as trainer_module
import rollout.rollouts as rollouts_module
from data.rewards import RewardResult
from grpo.config import LoraConfig, ModelConfig, OptimConfig, load_config
from grpo.update import PackedStep, build_optimizer, packed_logprobs
from models.lora import adapters_off, is_adapter_name, lora_modules, merged_weight
from models.parallel import build_parallel_dims, full_value, init_distributed
from models.policy import build_policy
from tests.test_full_state_dict import set_full_value
from tests.test_nonfinite import text_batch

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "logging.tensorboard=false",
        "trainer.progress=false", "trainer.eval_every=0", "checkpoint.every_steps=1"]


def varied_reward(task, response, answer, **_):
    """A reward that differs between the responses of a group (the random model never answers right),
    so advantages are non-zero and the step has something to learn."""
    value = float(len(response) % 3) / 2
    return RewardResult(value, value, 0.0)


def run_trainer(config, overrides):
    init_distributed()
    cfg = load_config(config, overrides)
    trainer = trainer_module.Trainer(cfg)
    base = {n: full_value(t).clone() for n, t in trainer.policy.model.state_dict().items() if not is_adapter_name(n)}
    trainer.train()
    return trainer, base


def check_only_adapters_moved(trainer, base, run_dir):
    policy = trainer.policy
    for name, tensor in policy.model.state_dict().items():
        if not is_adapter_name(name):
            assert torch.equal(full_value(tensor), base[name]), name  # frozen
    moved = [m for m in lora_modules(policy.model).values() if float(full_value(m.lora_B.detach()).abs().sum()) > 0]
    assert moved, "no adapter moved"
    assert len(trainer.optimizer.state) == 2 * len(lora_modules(policy.model))
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["loss/grad_norm"] > 0 and row["loss/skipped_nonfinite"] == 0
    lora = json.loads((run_dir / "checkpoints" / "step_1" / "lora.json").read_text())
    assert lora["rank"] == 4 and len(lora["modules"]) == len(lora_modules(policy.model))
    return row


def test_grpo_step_with_lora(tiny_model, clevr_parquet, tmp_path, monkeypatch):
    monkeypatch.setattr(rollouts_module, "score", varied_reward)
    run = tmp_path / "grpo"
    trainer, base = run_trainer("configs/demo.yaml", [
        f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "data.eval_path=", f"trainer.run_dir={run}",
        "trainer.max_steps=1", "data.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=6",
        "data.min_pixels=3136", "data.max_pixels=3136", "optim.warmup_steps=0", "algorithm.kl_coef=0.01", *LORA])
    row = check_only_adapters_moved(trainer, base, run)
    assert row["reward/std"] > 0
    # The reference model is the policy itself with its adapters off: no frozen copy. The KL term is reported
    # (the second of demo.yaml's two PPO epochs runs after the adapters moved, so it is above 0).
    assert trainer.ref is trainer.policy and row["loss/kl"] > 0
    step = PackedStep(text_batch(trainer.policy, vocab=64), 1 << 30, trainer.policy.device)
    with adapters_off(trainer.policy.model):
        packed_logprobs(trainer.policy, step, "off")
    packed_logprobs(trainer.policy, step, "on")
    frozen = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims(), trainable=False)
    packed_logprobs(frozen, step, "copy")
    off, on, copy = (torch.cat([f[k] for _, f in step]) for k in ("off", "on", "copy"))
    assert torch.equal(off, copy) and not torch.equal(on, copy)  # the adapters moved; off, it is the base
    # The next rollout's engine holds the merged weights under base names.
    trainer.colocation.refit()
    held = dict(trainer.colocation.engine.model.named_parameters())
    for name, module in lora_modules(trainer.policy.model).items():
        assert torch.equal(held[name + ".weight"], merged_weight(module).to(held[name + ".weight"].dtype)), name


def test_sft_step_with_lora(tiny_model, clevr_parquet, tmp_path):
    run = tmp_path / "sft"
    trainer, base = run_trainer("configs/sft_clevr_tiny.yaml", [
        f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", f"trainer.run_dir={run}", "trainer.max_steps=1",
        "data.prompts_per_step=4", "data.shuffle=false", "optim.warmup_steps=0", *LORA])
    check_only_adapters_moved(trainer, base, run)


# --- two ranks -------------------------------------------------------------------------------------

def one_update(model_path: str) -> tuple[dict, dict]:
    """A LoRA policy whose B holds a fixed non-zero draw takes one AdamW step on a fixed batch (the
    same batch on every rank); returns the merged full weights before and after (a collective)."""
    from tests.test_lora import sequences

    policy = build_policy(ModelConfig(path=model_path, dtype="float32", attn_implementation="sdpa",
                                      lora=LoraConfig(rank=4, alpha=8.0)), build_parallel_dims())
    g = torch.Generator().manual_seed(3)
    for m in lora_modules(policy.model).values():  # the same full B on every rank; each keeps its shard
        full = torch.randn(m.lora_B.shape, generator=g) * 0.05
        set_full_value(m.lora_B, full)
    before = {n: t.clone() for n, t in policy.full_state_dict()}
    opt = build_optimizer(policy, OptimConfig(lr=1e-2))
    lp, _ = policy.logprobs(sequences(policy.adapter))
    (-lp.mean()).backward()
    opt.step()
    return before, {n: t.clone() for n, t in policy.full_state_dict()}


@pytest.mark.slow
def test_two_rank_fsdp_update_matches_one_rank(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import run_torchrun

    out = tmp_path / "two.safetensors"
    run_torchrun(["-m", "tests.test_lora_train", str(tiny_model), str(out)], nproc=2)
    two = load_file(str(out))
    init_distributed()
    before, one = one_update(str(tiny_model))
    assert one.keys() == two.keys() and not any(is_adapter_name(n) for n in one)
    for name, tensor in one.items():
        assert torch.allclose(tensor, two[name], atol=1e-6, rtol=1e-5), name
    assert sum(not torch.equal(before[n], one[n]) for n in one) == len(lora_modules_of(tiny_model))


def lora_modules_of(model_path) -> list[str]:
    """The layers the default targets adapt in the tiny model: the weights one update changes."""
    from transformers import AutoModelForImageTextToText

    from models.family import build_adapter
    from models.lora import DEFAULT_TARGETS, lora_module_names
    from models.policy import load_model_config

    config = load_model_config(str(model_path))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return lora_module_names(model, build_adapter(config), list(DEFAULT_TARGETS))


if __name__ == "__main__":  # one rank of the two-rank test, under torchrun
    import sys

    from safetensors.torch import save_file

    init_distributed()
    torch.set_num_threads(1)
    _, after = one_update(sys.argv[1])
    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in after.items()}, sys.argv[2])
    dist.barrier()
    dist.destroy_process_group()
