"""model.liger_kernel: auto/true/false in the config, what auto settles to for a device, a family and an installed
package (the kernels themselves are Triton: CUDA only), and the settled value the run's config.yaml records."""

import logging

import pytest
import torch
import yaml

from grpo.config import ConfigError, load_config, save_config
from models.policy import LIGER_MEASURED_FAMILIES, apply_liger_kernels, uses_liger
from tools.loop_summary import read_settings


# --- config ---------------------------------------------------------------------------------------------------------
def test_auto_is_the_default_and_booleans_read_as_true_and_false(tmp_path):
    assert load_config(None, []).model.liger_kernel == "auto"
    assert load_config(None, ["model.liger_kernel=true"]).model.liger_kernel == "true"
    assert load_config(None, ["model.liger_kernel=false"]).model.liger_kernel == "false"
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  liger_kernel: true\n")
    assert load_config(str(path)).model.liger_kernel == "true"
    with pytest.raises(ConfigError, match=r"model.liger_kernel.*one of 'auto', 'true', 'false'"):
        load_config(None, ["model.liger_kernel=sometimes"])


@pytest.mark.parametrize("overrides", [["rollout.exact=true"], ["model.compile=true"]])
def test_auto_settles_off_under_exact_and_compile(overrides):
    assert load_config(None, overrides).model.liger_kernel == "false"
    assert load_config(None, [*overrides, "model.liger_kernel=false"]).model.liger_kernel == "false"


def test_true_with_compile_names_both_keys():
    with pytest.raises(ConfigError, match=r"'model.liger_kernel' and 'model.compile' are both true.*dynamo.*"
                                          r"LigerRMSNormFunction.*set one of them to false"):
        load_config(None, ["model.liger_kernel=true", "model.compile=true"])
    assert load_config(None, ["model.liger_kernel=false", "model.compile=true"]).model.compile


def test_true_with_exact_is_refused():
    with pytest.raises(ConfigError, match=r"'model.liger_kernel' is true; it needs auto or false .* rollout.exact"):
        load_config(None, ["rollout.exact=true", "model.liger_kernel=true"])


def test_settled_value_round_trips_and_reads_as_a_boolean_in_the_summary(tmp_path):
    for word, meaning in (("true", True), ("false", False)):
        cfg = load_config(None, [f"model.liger_kernel={word}"])
        save_config(cfg, tmp_path / "config.yaml")
        assert load_config(str(tmp_path / "config.yaml")) == cfg
        assert read_settings(tmp_path / "config.yaml")["liger_kernel"] is meaning
    (tmp_path / "old.yaml").write_text("model:\n  liger_kernel: true\n")  # a run from before auto: a boolean
    assert read_settings(tmp_path / "old.yaml")["liger_kernel"] is True


# --- what auto settles to -------------------------------------------------------------------------------------------
def test_auto_takes_liger_only_on_cuda_for_a_measured_family_with_the_package():
    assert LIGER_MEASURED_FAMILIES == {"qwen2_5_vl"}
    assert uses_liger("auto", "qwen2_5_vl", "cuda", importable=True)
    assert not uses_liger("auto", "qwen2_5_vl", "cpu", importable=True)
    assert not uses_liger("auto", "qwen2_vl", "cuda", importable=True)  # liger has kernels for it, not measured
    assert not uses_liger("auto", "qwen3_vl", "cuda", importable=True)
    assert not uses_liger("auto", "qwen2_5_vl", "cuda", importable=False)


@pytest.mark.parametrize("setting, expected", [("true", True), (True, True), ("false", False), (False, False)])
def test_true_and_false_decide_alone(setting, expected):
    for device, family, importable in (("cpu", "llava", False), ("cuda", "qwen2_5_vl", True)):
        assert uses_liger(setting, family, device, importable) is expected


def test_missing_package_on_a_measured_gpu_says_how_to_install_it_once(caplog):
    with caplog.at_level(logging.INFO, logger="vlrl"):
        uses_liger("auto", "qwen2_5_vl", "cuda", importable=False, hint=True)
        uses_liger("auto", "qwen2_5_vl", "cuda", importable=False)  # the reference's build: no second line
        uses_liger("auto", "qwen2_5_vl", "cpu", importable=False, hint=True)  # not measured off CUDA: nothing
        uses_liger("auto", "qwen2_vl", "cuda", importable=False, hint=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install -e .[liger]" in lines[0] and "2.87 -> 2.65 s" in lines[0]


def test_true_on_cpu_still_raises():
    with pytest.raises(RuntimeError, match="model.liger_kernel=true needs CUDA"):
        apply_liger_kernels("qwen2_5_vl", "cpu")


# --- the trainer ----------------------------------------------------------------------------------------------------
def _trainer_cfg(tiny_model, clevr_parquet, run_dir, overrides=()):
    return load_config(None, [
        "trainer.mode=grpo", f"model.path={tiny_model}", f"data.train_path={clevr_parquet}", "rollout.engine=torch",
        "rollout.n=2", "data.prompts_per_step=2", "data.min_pixels=3136", "data.max_pixels=3136",
        f"trainer.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.resume=never", *overrides,
    ])


ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's settling (on CUDA auto may take liger)")


@ON_CPU
def test_auto_on_cpu_builds_without_liger_and_records_false(tiny_model, clevr_parquet, tmp_path, capsys):
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    trainer = Trainer(_trainer_cfg(tiny_model, clevr_parquet, tmp_path / "run"))
    try:
        assert trainer.policy.liger_kernel is False and trainer.cfg.model.liger_kernel == "false"
        saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
        assert saved["model"]["liger_kernel"] == "false"  # what ran, not auto
        assert read_settings(tmp_path / "run" / "config.yaml")["liger_kernel"] is False
        assert "liger kernels: off (model.liger_kernel=auto)" in capsys.readouterr().out
    finally:
        trainer.rollouts.close()


@ON_CPU
def test_true_on_cpu_fails_building_the_policy(tiny_model, clevr_parquet, tmp_path):
    from grpo.trainer import Trainer
    from models.parallel import init_distributed

    init_distributed()
    with pytest.raises(RuntimeError, match=r"model.liger_kernel=true needs CUDA .* set it to auto or false"):
        Trainer(_trainer_cfg(tiny_model, clevr_parquet, tmp_path / "run", ["model.liger_kernel=true"]))
