"""The parts a step's phases are split into: the refit's (cache, the policy's side of the stream, the engine's) and
the host's packing before the first logprob pass, logged with the step (an in-process run on the CPU)."""

import json

from tests.test_gc_freeze import _trainer


def test_the_refit_and_the_packing_are_split_out(tiny_model, clevr_parquet, tmp_path):
    trainer = _trainer(tiny_model, clevr_parquet, tmp_path / "run", "trainer.max_steps=2", "algorithm.kl_coef=0.01")
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        parts = [r["perf/refit_cache_s"], r["perf/refit_gather_s"], r["perf/refit_engine_s"]]
        assert all(p >= 0 for p in parts) and r["perf/refit_gather_s"] > 0 and r["perf/refit_engine_s"] > 0
        assert abs(sum(parts) - r["perf/refit_s"]) < 0.01  # the refit is nothing but its parts
        assert 0 < r["perf/logprob_pack_s"] < r["perf/logprob_s"]  # the reference pass comes after
