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


def test_out_of_memory_names_the_pass_and_what_lowers_it(tiny_model, clevr_parquet, tmp_path, monkeypatch):
    """A step that runs out of device memory stops with one message: the pass (the update here, step 2), the
    micro-batch setting that lowers its need, and the newest checkpoint (step 1); outside the training passes it
    points at the engine's share instead, and says when the run has no checkpoint."""
    import torch

    from grpo import trainer as trainer_module
    from grpo.trainer import OutOfMemoryStop

    real, calls = trainer_module.optimizer_step, []

    def update_runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 302.00 MiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "optimizer_step", update_runs_out)
    trainer = small_trainer(tiny_model, clevr_parquet, tmp_path / "run", "trainer.max_steps=3",
                            "checkpoint.every_steps=1", "optim.max_tokens_per_microbatch=512")
    with pytest.raises(OutOfMemoryStop) as info:
        trainer.train()
    message = str(info.value)
    assert message.startswith("step 2 ran out of device memory in the update (model.dtype=")
    assert "lower optim.max_tokens_per_microbatch (now 512; 256 halves" in message
    assert "model.activation_checkpointing=true" in message
    assert "the newest checkpoint is step 1; resume with checkpoint.resume=auto" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert trainer.colocation.peak.pass_label == "update"

    def generation_runs_out(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    fresh = small_trainer(tiny_model, clevr_parquet, tmp_path / "run2")
    monkeypatch.setattr(fresh.rollouts, "collect", generation_runs_out)
    with pytest.raises(OutOfMemoryStop) as info:
        fresh.train()
    message = str(info.value)
    assert "step 1 ran out of device memory outside the logprob and update passes" in message
    assert "rollout.gpu_memory_utilization" in message and "this run has no checkpoint yet" in message


def test_profile_step_writes_that_steps_op_tables(tiny_model, clevr_parquet, tmp_path):
    """trainer.profile_step=2: step 2's logprob and update passes run under torch.profiler, their op tables in
    <run_dir>/profile_step_2.txt; the other steps are not profiled."""
    run = tmp_path / "run"
    small_trainer(tiny_model, clevr_parquet, run, "trainer.max_steps=2", "trainer.profile_step=2").train()
    (written,) = run.glob("profile_step_*.txt")
    assert written.name == "profile_step_2.txt"
    text = written.read_text()
    assert text.startswith("step 2's logprob and update passes: ") and "aten::" in text
    # the passes' phases by name (models.phases.phase_range), each with its host time
    phases = text.split("--- phases (vlrl: ranges")[1]
    for name in ("pack", "vision tower", "language model", "logprobs", "loss", "backward", "clip and optimizer step"):
        assert f"x  {name}\n" in phases, name


def test_profile_step_must_not_be_negative():
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.profile_step"):
        load_config(None, ["trainer.profile_step=-1"])
