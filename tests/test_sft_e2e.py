"""SFT end to end through torchrun on CPU: 1 vs 2 ranks, resume exactness, merge exactness, bad rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow
DETERMINISTIC = ("loss/total", "loss/grad_norm", "optim/lr", "perf/tokens", "perf/scored_tokens")


@pytest.fixture(scope="module")
def corrupt_parquet(clevr_parquet, tmp_path_factory):
    """The CLEVR file with two rows' images replaced by junk bytes."""
    table = pq.read_table(clevr_parquet)
    images = table.column("images").to_pylist()
    images[1] = [{"bytes": b"not an image at all", "path": "x.png"}]
    images[5] = [{"bytes": images[5][0]["bytes"][:40], "path": "y.png"}]  # truncated PNG
    table = table.set_column(table.schema.get_field_index("images"), "images", pa.array(images, type=table.schema.field("images").type))
    out = tmp_path_factory.mktemp("bad") / "clevr_bad.parquet"
    pq.write_table(table, out)
    return out


def sft_args(model, data, run_dir, steps, extra=()):
    return ["train.py", "--config", "configs/sft_clevr_tiny.yaml", f"model.path={model}", f"data.train_path={data}",
            f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", "data.prompts_per_step=4",
            "data.shuffle=false", "logging.tensorboard=false", *extra]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_two_ranks_match_one(tiny_model, clevr_parquet, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_torchrun(sft_args(tiny_model, clevr_parquet, one, 3), nproc=1)
    run_torchrun(sft_args(tiny_model, clevr_parquet, two, 3), nproc=2)
    r1, r2 = rows(one), rows(two)
    assert [r["step"] for r in r2] == [1, 2, 3]
    for a, b in zip(r1, r2):
        for k in ("loss/total", "loss/grad_norm", "perf/scored_tokens"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
    w1 = load_file(str(_merge(one / "checkpoints" / "step_3", tmp_path / "m1") / "model.safetensors"))
    w2 = load_file(str(_merge(two / "checkpoints" / "step_3", tmp_path / "m2") / "model.safetensors"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4


def test_sft_skips_bad_rows_learns_and_resumes_exactly(tiny_model, corrupt_parquet, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = run_torchrun(sft_args(tiny_model, corrupt_parquet, full, 4, ["checkpoint.every_steps=2"]), nproc=2)
    assert "skipping row 1" in proc.stderr and "skipping row 5" in proc.stderr
    r2 = rows(full)
    assert [r["step"] for r in r2] == [1, 2, 3, 4]
    assert r2[-1]["data/skipped_samples"] == 2
    assert r2[-1]["loss/total"] < r2[0]["loss/total"]  # it learns
    # stop after 2, resume to 4: identical rows for 3-4
    run_torchrun(sft_args(tiny_model, corrupt_parquet, resumed, 2, ["checkpoint.every_steps=2"]), nproc=2)
    proc = run_torchrun(sft_args(tiny_model, corrupt_parquet, resumed, 4, ["checkpoint.every_steps=2"]), nproc=2)
    assert "resumed from" in proc.stdout
    r3 = rows(resumed)
    assert [r["step"] for r in r3] == [1, 2, 3, 4]
    for a, b in zip(r2, r3):
        for k in DETERMINISTIC:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    assert (resumed / "config.yaml").is_file() and (resumed / "checkpoints" / "latest").read_text().strip() == "step_4"


def _merge(ckpt, out):
    from tools.checkpoint_merge import merge_checkpoint

    return merge_checkpoint(ckpt, out)


def test_merge_equals_trained_policy(tiny_model, clevr_parquet, tmp_path):
    """The merged folder loads with transformers and gives the trained policy's logits."""
    from transformers import AutoModelForImageTextToText

    run = tmp_path / "run"
    run_torchrun(sft_args(tiny_model, clevr_parquet, run, 2, ["optim.lr=0.01"]), nproc=2)
    out = _merge(run / "checkpoints" / "step_2", tmp_path / "merged")
    names = set(load_file(str(out / "model.safetensors")))
    assert "lm_head.weight" in names
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in names)
    for f in ("config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (out / f).is_file()
    merged = AutoModelForImageTextToText.from_pretrained(str(out), local_files_only=True).eval()
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_model), local_files_only=True).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert not torch.allclose(a, b)  # training changed the weights ...
    # ... and the merged weights are the checkpoint's: load the DCP shards directly and compare
    from grpo.checkpoint import load_full_model_state

    fresh = AutoModelForImageTextToText.from_pretrained(str(tiny_model), local_files_only=True).eval()
    load_full_model_state(run / "checkpoints" / "step_2", fresh)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, a)
