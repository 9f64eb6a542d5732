"""With one PPO epoch the update's own forward supplies the old logprobs; it must equal the separate pass."""

import torch

from grpo.config import load_config
from models.parallel import full_value


def _trainer(tiny_model, clevr_parquet, run_dir, threshold):
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never", "optim.lr=1e-2",
        "optim.max_tokens_per_microbatch=96", f"algorithm.mismatch_mask_threshold={threshold}",
    ])
    return Trainer(cfg)


def _step(trainer):
    """Two prompts × two responses packed once, as the trainer's experience phase packs them."""
    from grpo.update import PackedStep

    g = torch.Generator().manual_seed(0)
    prompts = trainer.feeder.next(2)
    responses = [torch.randint(0, 500, (n,), generator=g) for n in (5, 9, 7, 3)]
    batch = trainer._sequence_batch(prompts, responses, [0, 0, 1, 1])
    step = PackedStep(batch, 96, trainer.policy.device)
    step.set_per_token("engine_logprobs", [-torch.rand(r.numel(), generator=g) * 8 for r in responses])
    step.set_per_sequence("advantages", torch.tensor([1.0, -1.0, 0.5, -0.5]))
    return step


def test_update_forward_gives_the_old_logprobs(tiny_model, clevr_parquet, tmp_path):
    from grpo.update import packed_logprobs

    reuse = _trainer(tiny_model, clevr_parquet, tmp_path / "reuse", 0.0)
    separate = _trainer(tiny_model, clevr_parquet, tmp_path / "separate", 1e9)  # masks nothing, forces the pass
    assert reuse._old_logprobs_from_update() and not separate._old_logprobs_from_update()

    s1 = _step(separate)
    assert len(s1.microbatches) > 1  # the fields must survive several micro-batches
    packed_logprobs(separate.policy, s1, "old_logprobs")
    fid1 = separate._fidelity(s1)
    out1 = separate._ppo_update(s1)

    s2 = _step(reuse)
    out2 = reuse._ppo_update(s2, old_from_update=True)
    fid2 = reuse._fidelity(s2)

    assert out1["loss/total"] != 0 and out1["loss/grad_norm"] > 0  # something was learned
    for a, b in zip(s1.per_sample("old_logprobs"), s2.per_sample("old_logprobs")):
        assert a.numel() > 0 and a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
    for k in ("loss/total", "loss/grad_norm", "loss/entropy", "loss/clip_fraction"):
        assert abs(out1[k] - out2[k]) <= 1e-5 * max(1.0, abs(out1[k])), k
    for k in fid1:
        assert abs(fid1[k] - fid2[k]) <= 1e-6, k
    for (n, p1), (_, p2) in zip(separate.policy.model.named_parameters(), reuse.policy.model.named_parameters()):
        assert torch.allclose(full_value(p1), full_value(p2), atol=1e-6), n
