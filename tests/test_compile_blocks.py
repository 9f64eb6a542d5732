"""model.compile: each decoder block's forward compiled in place gives the eager logprobs and gradients."""

import os

import pytest
import torch

from grpo.update import PackedStep, sequence_logprobs
from models.parallel import full_value


def _trainer(tiny_model, clevr_parquet, run_dir, compile_blocks):
    from grpo.config import load_config
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never", "optim.lr=1e-2",
        "optim.max_tokens_per_microbatch=96", f"model.compile={str(compile_blocks).lower()}",
    ])
    return Trainer(cfg)


def _batch(trainer):
    g = torch.Generator().manual_seed(0)
    prompts = trainer.feeder.next(2)
    responses = [torch.randint(0, 500, (n,), generator=g) for n in (5, 9, 7, 3)]
    return trainer._sequence_batch(prompts, responses, [0, 0, 1, 1])


@pytest.mark.slow
def test_compiled_blocks_match_eager(tiny_model, clevr_parquet, tmp_path):
    eager = _trainer(tiny_model, clevr_parquet, tmp_path / "eager", False)
    compiled = _trainer(tiny_model, clevr_parquet, tmp_path / "compiled", True)
    layers = compiled.adapter.decoder_layers(compiled.policy.model)
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)  # really compiled
    names = [n for n, _ in compiled.policy.model.named_parameters()]
    assert names == [n for n, _ in eager.policy.model.named_parameters()]  # checkpoint names unchanged

    b1, b2 = _batch(eager), _batch(compiled)
    lp1, _ = sequence_logprobs(eager.policy, b1, 96)
    lp2, _ = sequence_logprobs(compiled.policy, b2, 96)  # several micro-batches: rows of other lengths
    for a, b in zip(lp1, lp2):
        assert a.numel() and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()

    for t, b in ((eager, b1), (compiled, b2)):
        for mb, _ in PackedStep(b, 96, t.policy.device):
            if mb.sample_indices:
                lp, _ = t.policy.logprobs(mb)
                lp.sum().backward()
    compared = 0
    for (n, p1), (_, p2) in zip(eager.policy.model.named_parameters(), compiled.policy.model.named_parameters()):
        if p1.grad is None:
            continue
        g1, g2 = full_value(p1.grad), full_value(p2.grad)
        assert torch.allclose(g1, g2, atol=1e-5, rtol=1e-4), (n, (g1 - g2).abs().max())
        compared += 1
    assert compared > 10


def test_compile_keeps_inductor_kernels_in_the_users_cache(monkeypatch, tmp_path):
    from models.parallel import apply_compile

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    apply_compile([torch.nn.Linear(2, 2)])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vlrl" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # a user's own setting stands
    apply_compile([torch.nn.Linear(2, 2)])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
