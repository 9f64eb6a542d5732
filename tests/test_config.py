import subprocess
import sys

import pytest
import yaml

from grpo.config import Config, ConfigError, load_config, parse_override, save_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_steps: 7\noptim:\n  lr: 1e-6\n")
    cfg = load_config(str(path), ["trainer.seed=3", "rollout.temperature=0.5", "model.path=/x", "optim.warmup_steps=2"])
    assert cfg.trainer.max_steps == 7 and cfg.trainer.seed == 3
    assert cfg.optim.lr == pytest.approx(1e-6) and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.temperature == 0.5 and cfg.model.path == "/x" and cfg.optim.warmup_steps == 2


def test_unknown_key_names_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_step'.*'max_steps'"):
        load_config(None, ["trainer.max_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainr'.*'trainer'"):
        load_config(None, ["trainr.max_steps=3"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="optim.learning_rate"):
        load_config(str(path))


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*expected int"):
        load_config(None, ["trainer.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"rollout.engine.*one of"):
        load_config(None, ["rollout.engine=tensorrt"])
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*expected int"):
        load_config(None, ["trainer.max_steps=true"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, ["trainer=3"])


def test_int_widens_to_float_and_cross_checks():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config(None, ["algorithm.dual_clip=0.5"])


def test_parse_override_nested():
    assert parse_override("a.b.c=2") == {"a": {"b": {"c": 2}}}
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.max_steps=5", "data.task=geo3k"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg and isinstance(again, Config)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["task"] == "geo3k"


def test_repo_configs_load():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")):
        load_config(str(path))


def test_train_cli_reports_typo():
    proc = subprocess.run([sys.executable, "train.py", "trainer.max_stepz=1"], capture_output=True, text=True,
                          cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert "trainer.max_stepz" in proc.stderr and "max_steps" in proc.stderr
