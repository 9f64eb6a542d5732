"""optim.reserve_cache: the step puts its passes' cache in place before the logprob pass."""
from contextlib import contextmanager

from grpo.config import load_config


def test_the_reserve_comes_before_the_steps_passes(tiny_model, clevr_parquet, tmp_path, monkeypatch):
    import grpo.trainer as trainer_module
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    cfg = load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        "rollout.max_new_tokens=8", f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false",
        "checkpoint.resume=never", "optim.reserve_cache=true",
    ])
    trainer = Trainer(cfg)
    events = []
    monkeypatch.setattr(trainer_module, "reserve_cache", lambda device, nbytes: events.append(("reserve", nbytes))
                        or nbytes)
    training = trainer.colocation.peak.training

    @contextmanager
    def recorded(label=None):
        events.append(("pass", label))
        with training(label):
            yield

    monkeypatch.setattr(trainer.colocation.peak, "training", recorded)
    try:
        trainer._reserve_bytes = 3 << 20  # as a previous step on a GPU would have left it
        m = trainer.grpo_step(2)
    finally:
        trainer.rollouts.close()
    assert events == [("reserve", 3 << 20), ("pass", "logprob"), ("pass", "update")]
    assert m["perf/reserve_s"] >= 0
    # on a CPU there is no cache to size: the next step's reserve is left as it was
    assert trainer._reserve_bytes == 3 << 20 and "memory/reserved_gb" not in m
