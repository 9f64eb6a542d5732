"""Start-up checks fail before anything heavy loads, naming the key to change; K non-finite steps stop a run."""

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.config import ConfigError, load_config
from grpo.preflight import preflight
from tests.conftest import ROOT


def cfg_for(model, data, *extra):
    return load_config(None, [f"model.path={model}", f"data.train_path={data}", "rollout.engine=torch", *extra])


def test_good_config_passes(tiny_model, clevr_parquet):
    preflight(cfg_for(tiny_model, clevr_parquet))


def test_batch_must_divide_across_ranks(tiny_model, clevr_parquet):
    preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=8"), world_size=4)
    with pytest.raises(ConfigError, match="data.prompts_per_step=6 does not divide across 4"):
        preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=6"), world_size=4)
    with pytest.raises(ConfigError, match="parallel.tp=3"):
        preflight(cfg_for(tiny_model, clevr_parquet, "parallel.tp=3"), world_size=4)


def test_hsdp_replicas_must_divide_data_parallel_ranks(tiny_model, clevr_parquet, monkeypatch):
    preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=8", "parallel.replicate=2"), world_size=4)
    with pytest.raises(ConfigError, match="parallel.replicate=3"):
        preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=12", "parallel.replicate=3"), world_size=4)
    with pytest.raises(ConfigError, match="must be 0"):
        preflight(cfg_for(tiny_model, clevr_parquet, "parallel.replicate=-1"), world_size=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # 0 = one replica per node: 6 ranks on nodes of 3 → 2
    preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=6", "parallel.replicate=0"), world_size=6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 8 ranks, tp 4 → dp 2; nodes of 4 → 2 replicas
    preflight(cfg_for(tiny_model, clevr_parquet, "data.prompts_per_step=2", "parallel.replicate=0", "parallel.tp=4"),
              world_size=8)


def test_model_folder_problems(tiny_model, clevr_parquet, tmp_path):
    with pytest.raises(ConfigError, match="model.path.*config.json"):
        preflight(cfg_for(tmp_path / "nothing", clevr_parquet))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (odd / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="'llama' is not supported; supported: .*qwen2_5_vl, qwen2_vl"):
        preflight(cfg_for(odd, clevr_parquet))
    (odd / "model.safetensors").unlink()
    (odd / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="never pickle"):
        preflight(cfg_for(odd, clevr_parquet))


def test_data_and_engine_problems(tiny_model, clevr_parquet, tmp_path):
    with pytest.raises(ConfigError, match="data.train_path.*not found"):
        preflight(cfg_for(tiny_model, tmp_path / "missing.parquet"))
    with pytest.raises(ConfigError, match="data.eval_path"):
        preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={tmp_path / 'missing.parquet'}"))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="rollout.engine=vllm"):
            preflight(cfg_for(tiny_model, clevr_parquet, "rollout.engine=vllm"))


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_model_folder_files_are_checked_by_name(tiny_model, clevr_parquet, tmp_path):
    model = _copy_model(tiny_model, tmp_path / "m")
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ConfigError, match=r"model.safetensors is truncated: its header describes \d+ bytes"):
        preflight(cfg_for(model, clevr_parquet))
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match="model.safetensors is not a safetensors file"):
        preflight(cfg_for(model, clevr_parquet))
    (model / "model.safetensors").write_bytes(weights)
    preflight(cfg_for(model, clevr_parquet))
    (model / "tokenizer.json").write_text('{"torn": ')
    with pytest.raises(ConfigError, match="tokenizer.json is not valid JSON"):
        preflight(cfg_for(model, clevr_parquet))
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer .tokenizer.json, tokenizer.model, vocab.json"):
        preflight(cfg_for(model, clevr_parquet))
    (model / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        preflight(cfg_for(model, clevr_parquet))


def test_sharded_weights_name_the_missing_shard(tiny_model, clevr_parquet, tmp_path):
    model = _copy_model(tiny_model, tmp_path / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors is missing"):
        preflight(cfg_for(model, clevr_parquet))


def test_train_and_eval_files_are_sampled_before_training(tiny_model, clevr_parquet, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"images": [f"gone_{i}.png"], "problem": "<image> how many?", "answer": "3"})
                           + "\n" for i in range(20)))
    with pytest.raises(ConfigError) as info:
        preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={bad}"))
    message = str(info.value)
    assert message.startswith(f"data.eval_path='{bad}': none of 8 rows sampled across its 20 rows is usable")
    assert "missing_image: 8" in message
    with pytest.raises(ConfigError, match="data.train_path=.*none of 8 rows"):
        preflight(cfg_for(tiny_model, bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="data.eval_path=.*(no rows|empty)"):
        preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={empty}"))
    columns = tmp_path / "columns.jsonl"
    columns.write_text(json.dumps({"picture": "x.png", "q": "?", "a": "1"}) + "\n")
    with pytest.raises(ConfigError, match="data.eval_path=.*columns.jsonl"):
        preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={columns}"))
    preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={clevr_parquet}"))


@pytest.mark.slow
def test_nonfinite_steps_in_a_row_stop_with_checkpoint(tiny_model, clevr_parquet, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py",
           "--config", "configs/sft_clevr_tiny.yaml", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}",
           f"trainer.run_dir={run}", "trainer.max_steps=8", "optim.lr=1e30", "optim.grad_clip=0", "optim.warmup_steps=0",
           "trainer.max_nonfinite_in_row=3", "logging.tensorboard=false", "data.prompts_per_step=2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "3 non-finite steps in a row" in proc.stderr and "optim.lr" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"


def test_vllm_is_refused_for_families_it_cannot_run_yet(monkeypatch):
    """auto falls back to the built-in engine for such a family; an explicit vllm names the family."""
    from rollout import factory

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setitem(factory.VLLM_PENDING, "blip2", "its prompts are not collapsed yet")
    assert factory.resolve_engine_name("auto", "qwen2_5_vl") == "vllm"
    assert factory.resolve_engine_name("auto", "blip2") == "torch"
    with pytest.raises(RuntimeError, match="family 'blip2'.*not collapsed yet.*rollout.engine=torch"):
        factory.resolve_engine_name("vllm", "blip2")
    assert factory.resolve_engine_name("torch", "blip2") == "torch"
    monkeypatch.setitem(factory.VLLM_UNVERIFIED, "blip2_next", "not measured yet")
    assert factory.resolve_engine_name("auto", "blip2_next") == "torch"
    with pytest.warns(UserWarning, match="family 'blip2_next' is not yet measured.*not measured yet"):
        assert factory.resolve_engine_name("vllm", "blip2_next") == "vllm"
    for family in ("gemma3", "idefics3", "llava"):  # written for vLLM, awaiting a GPU measurement
        expected = "torch" if family in factory.VLLM_UNVERIFIED else "vllm"
        assert factory.resolve_engine_name("auto", family) == expected


@pytest.mark.parametrize("images,detail", [
    (pa.array([5] * 12, type=pa.int64()), "images is int"),
    (pa.array([[{"bytes": 5, "path": None}]] * 12, type=pa.list_(pa.struct([("bytes", pa.int64()),
                                                                             ("path", pa.string())]))),
     r"images\[0\]\.bytes is int"),
], ids=["images_int", "image_bytes_int"])
def test_wrong_column_types_fail_preflight_in_one_line(tiny_model, clevr_parquet, tmp_path, images, detail):
    bad = tmp_path / "types.parquet"
    pq.write_table(pa.table({"images": images, "problem": ["<image> how many?"] * 12, "answer": ["3"] * 12}), bad)
    with pytest.raises(ConfigError) as info:
        preflight(cfg_for(tiny_model, clevr_parquet, f"data.eval_path={bad}"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"data.eval_path='{bad}': none of 8 rows sampled across its 12 rows is usable "
                              "(wrong_type: 8; row 0: wrong_type: ")
    assert re.search(detail, message), message
