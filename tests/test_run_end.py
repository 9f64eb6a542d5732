"""The end of a run: `checkpoint.at_end` decides whether the last step is saved, and every step's metrics carry
`memory/alloc_retries` (0 on CPU, where torch's device allocator is not used; the per-pass allocator metrics
are left out there)."""

import json

import pytest

from grpo.config import load_config
from models.parallel import init_distributed


def small_trainer(model, data, run_dir, *extra):
    """A one-step GRPO trainer on the built-in engine, 2 prompts x 2 responses x 4 tokens; `extra` overrides win."""
    from grpo.trainer import Trainer

    init_distributed()
    return Trainer(load_config(None, [
        f"model.path={model}", f"data.train_path={data}", "rollout.engine=torch", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.max_new_tokens=4", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never",
        "trainer.max_steps=1", *extra,
    ]))


def _train(model, data, run_dir, *extra):
    small_trainer(model, data, run_dir, *extra).train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("at_end", [True, False])
def test_checkpoint_at_end(tiny_model, clevr_parquet, tmp_path, at_end):
    run = tmp_path / "run"
    (row,) = _train(tiny_model, clevr_parquet, run, f"checkpoint.at_end={str(at_end).lower()}")
    assert (run / "checkpoints" / "step_1").is_dir() == at_end
    assert row["memory/alloc_retries"] == 0.0 and row["memory/peak_gb"] > 0
    assert not [k for k in row if k.startswith(("memory/alloc_retries_", "memory/inactive_split"))]  # GPU only
