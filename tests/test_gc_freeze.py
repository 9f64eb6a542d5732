"""trainer.gc_freeze: after the first step the objects then alive are frozen out of the garbage collector's walks,
and the loop's end gives them back."""

import gc
import weakref

import pytest

from grpo.config import load_config
from grpo.trainer import Trainer, freeze_survivors
from models.parallel import init_distributed


def _trainer(tiny_model, clevr_parquet, run_dir, *extra) -> Trainer:
    init_distributed()
    return Trainer(load_config("configs/demo.yaml", [
        f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "data.eval_path=", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        "rollout.max_new_tokens=4", f"trainer.run_dir={run_dir}", "logging.tensorboard=false",
        "checkpoint.resume=never", "checkpoint.every_steps=0", "checkpoint.at_end=false", "trainer.eval_every=0",
        "trainer.max_steps=3", *extra]))


def _run(trainer, monkeypatch) -> list[tuple[int, int]]:
    """Train; each step's (frozen objects, objects a full collection walks) as the step starts."""
    seen = []
    inner = trainer.grpo_step

    def step(per_rank):
        seen.append((gc.get_freeze_count(), len(gc.get_objects())))
        return inner(per_rank)

    monkeypatch.setattr(trainer, "grpo_step", step)
    trainer.train()
    return seen


@pytest.mark.parametrize("on", [True, False])
def test_the_loop_freezes_what_its_first_step_leaves(tiny_model, clevr_parquet, tmp_path, monkeypatch, capsys, on):
    before = gc.get_freeze_count()
    trainer = _trainer(tiny_model, clevr_parquet, tmp_path / "run", f"trainer.gc_freeze={str(on).lower()}")
    seen = _run(trainer, monkeypatch)
    assert len(seen) == 3 and seen[0][0] == before  # the first step runs as before
    printed = "objects alive after the first step frozen (trainer.gc_freeze)" in capsys.readouterr().out
    if on:
        assert printed
        for frozen, walked in seen[1:]:
            # the model, the engine, the libraries: out of every later walk; what a step makes is walked
            assert frozen > before + 10_000, seen
            assert walked < seen[0][1] / 4, seen
    else:
        assert not printed and [f for f, _ in seen] == [before] * 3
    assert gc.get_freeze_count() == before  # the loop's end gives them back


def test_freeze_survivors_collects_garbage_first():
    """Garbage in a cycle when the freeze comes is collected, not frozen; what is alive is frozen (no collection
    walks it) until `gc.unfreeze`."""

    class Node:
        pass

    garbage, alive = Node(), Node()
    garbage.me, alive.me = garbage, alive
    gone = weakref.ref(garbage)
    del garbage
    try:
        assert freeze_survivors() == gc.get_freeze_count() > 0
        assert gone() is None
        assert not any(o is alive for o in gc.get_objects())
        gc.unfreeze()
        assert any(o is alive for o in gc.get_objects())
    finally:
        gc.unfreeze()
