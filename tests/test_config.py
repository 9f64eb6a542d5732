"""The config loader: YAML + command line merged through OmegaConf, keys and types checked at load."""

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import grpo.config as config
from grpo.config import Config, ConfigError, load_config, parse_override, save_config

ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path / "c.yaml", "trainer:\n  max_steps: 7\noptim:\n  lr: 1e-6\n")
    cfg = load_config(path, ["trainer.seed=3", "rollout.temperature=0.5", "model.path=/x", "optim.warmup_steps=2"])
    assert isinstance(cfg, Config) and isinstance(cfg.trainer, config.TrainerConfig)
    assert cfg.trainer.max_steps == 7 and cfg.trainer.seed == 3
    assert cfg.optim.lr == pytest.approx(1e-6) and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.temperature == 0.5 and cfg.model.path == "/x" and cfg.optim.warmup_steps == 2


def test_command_line_overrides_yaml_and_later_overrides_win(tmp_path):
    path = write(tmp_path / "c.yaml", "trainer:\n  seed: 1\n  max_steps: 4\n")
    cfg = load_config(path, ["trainer.seed=2", "trainer.seed=5"])
    assert cfg.trainer.seed == 5 and cfg.trainer.max_steps == 4


def test_unknown_key_names_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_step'.*'max_steps'"):
        load_config(None, ["trainer.max_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainr'.*'trainer'"):
        load_config(None, ["trainr.max_steps=3"])
    path = write(tmp_path / "c.yaml", "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"optim.learning_rate.*c.yaml"):
        load_config(path)


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*expected int"):
        load_config(None, ["trainer.max_steps=abc"])
    with pytest.raises(ConfigError, match=r"rollout.engine.*one of 'auto', 'torch', 'vllm'.*tensorrt"):
        load_config(None, ["rollout.engine=tensorrt"])
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*expected int"):
        load_config(None, ["trainer.max_steps=true"])
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*expected int"):
        load_config(None, ["trainer.max_steps=2.5"])
    with pytest.raises(ConfigError, match=r"model.path.*expected a string, got the boolean"):
        load_config(None, ["model.path=true"])
    with pytest.raises(ConfigError, match=r"logging.tensorboard.*expected bool.*maybe"):
        load_config(None, ["logging.tensorboard=maybe"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, ["trainer=3"])
    with pytest.raises(ConfigError, match="trainer.seed.*is a value, not a section"):
        load_config(None, ["trainer.seed.x=3"])


def test_int_widens_to_float_and_cross_checks():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(None, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config(None, ["algorithm.dual_clip=0.5"])


def test_parse_override_nested():
    assert parse_override("a.b.c=2") == {"a": {"b": {"c": 2}}}
    assert parse_override("a.b=1e-6") == {"a": {"b": "1e-6"}}  # a float key converts it; a string key keeps it
    assert parse_override("a.b=") == {"a": {"b": ""}}
    for bad in ("novalue", "=3", "a..b=3"):
        with pytest.raises(ConfigError, match="key"):
            parse_override(bad)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.max_steps=5", "data.task=geo3k", "parallel.offload_during_generate=off",
                             "trainer.run_dir=runs/a #1/\\${HOME}/a\\\\\\${x}"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(str(tmp_path / "run" / "config.yaml"))
    assert again == cfg and isinstance(again, Config)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["task"] == "geo3k" and saved["parallel"]["offload_during_generate"] == "off"
    assert list(saved) == [f.name for f in config.dataclasses.fields(Config)]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.yaml"]  # no temporary file left


def test_saved_config_is_written_by_omegaconf(tmp_path, monkeypatch):
    calls = []
    real = config.OmegaConf.to_yaml
    monkeypatch.setattr(config.OmegaConf, "to_yaml", lambda conf, **kw: calls.append(conf) or real(conf, **kw))
    save_config(Config(), tmp_path / "config.yaml")
    assert len(calls) == 1 and config.OmegaConf.is_config(calls[0])


def test_repo_configs_load():
    paths = sorted(ROOT.glob("configs/*.yaml"))
    assert paths
    for path in paths:
        load_config(str(path))


def test_base_file_is_extended(tmp_path):
    (tmp_path / "recipes").mkdir()
    write(tmp_path / "base.yaml", "trainer:\n  max_steps: 9\n  seed: 4\nrollout:\n  n: 6\n")
    write(tmp_path / "mid.yaml", "base: base.yaml\ntrainer:\n  seed: 5\n")
    child = write(tmp_path / "recipes" / "child.yaml", "base: ../mid.yaml\nrollout:\n  n: 3\n")
    cfg = load_config(child, ["trainer.max_steps=2"])
    assert (cfg.trainer.max_steps, cfg.trainer.seed, cfg.rollout.n) == (2, 5, 3)
    both = write(tmp_path / "both.yaml", "base: [base.yaml, mid.yaml]\n")
    assert load_config(both).trainer.seed == 5  # later bases win


def test_repo_base_config_names_a_shipped_file(tmp_path):
    child = write(tmp_path / "c.yaml", f"base: {ROOT / 'configs' / 'demo.yaml'}\ntrainer:\n  max_steps: 3\n")
    cfg = load_config(child)
    demo = load_config(str(ROOT / "configs" / "demo.yaml"))
    assert cfg.trainer.max_steps == 3 and cfg.data == demo.data and cfg.rollout == demo.rollout


def test_base_file_problems(tmp_path):
    missing = write(tmp_path / "a.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml: base 'nowhere.yaml' not found"):
        load_config(missing)
    write(tmp_path / "x.yaml", "base: y.yaml\n")
    write(tmp_path / "y.yaml", "base: x.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(str(tmp_path / "x.yaml"))
    with pytest.raises(ConfigError, match="'base' must name a YAML file"):
        load_config(write(tmp_path / "b.yaml", "base: 3\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.base'"):
        load_config(write(tmp_path / "c.yaml", "trainer:\n  base: x.yaml\n"))


def test_interpolation_between_keys(tmp_path):
    path = write(tmp_path / "c.yaml", "trainer:\n  run_dir: runs/${data.task}_${trainer.seed}\n  seed: 7\n"
                                      "checkpoint:\n  resume: ${trainer.run_dir}/step_4\n")
    cfg = load_config(path, ["data.task=geo3k", "trainer.eval_every=${checkpoint.every_steps}",
                             "checkpoint.every_steps=5"])
    assert cfg.trainer.run_dir == "runs/geo3k_7" and cfg.checkpoint.resume == "runs/geo3k_7/step_4"
    assert cfg.trainer.eval_every == 5 and isinstance(cfg.trainer.eval_every, int)


def test_interpolation_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.path.*\$\{trainer.run_dri\} names no config key.*'run_dir'"):
        load_config(None, ["model.path=${trainer.run_dri}/m"])
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*run_dir"):
        load_config(None, ["trainer.max_steps=${trainer.run_dir}"])


def test_environment_and_resolvers_are_refused(monkeypatch):
    monkeypatch.setenv("VLRL_SECRET", "s3cret")
    for value in ("${HOME}/m", "${oc.env:VLRL_SECRET}", "\\\\${oc.env:VLRL_SECRET}"):
        with pytest.raises(ConfigError, match=r"'model.path'.*never an environment variable or a resolver"):
            load_config(None, [f"model.path={value}"])
    cfg = load_config(None, ["model.path=\\${HOME}/m", "data.eval_path=\\${trainer.seed}"])
    assert cfg.model.path == "${HOME}/m"  # OmegaConf's escape keeps the text as written
    assert cfg.data.eval_path == "${trainer.seed}"


def test_required_values(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  path: ???\ndata:\n  train_path: ???\n")
    with pytest.raises(ConfigError, match=r"\?\?\?.*data.train_path, model.path.*on the command line"):
        load_config(path, [])
    cfg = load_config(path, ["model.path=/m", "data.train_path=/d.parquet"])
    assert (cfg.model.path, cfg.data.train_path) == ("/m", "/d.parquet")


@dataclass
class _ListSection:
    backends: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    weights: list[float] = field(default_factory=list)


@dataclass
class _ConfigWithLists(Config):
    lists: _ListSection = field(default_factory=_ListSection)


def _list_keys(cls=Config, prefix=""):
    for name, tp in config._fields(cls).items():
        if config.dataclasses.is_dataclass(tp):
            yield from _list_keys(tp, f"{prefix}{name}.")
        elif config.typing.get_origin(tp) is list:
            yield f"{prefix}{name}"


def test_list_values_from_yaml_and_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "Config", _ConfigWithLists)
    assert load_config(None).lists.backends == ["tensorboard", "jsonl"]
    cfg = load_config(None, ["lists.backends=[tensorboard,jsonl,wandb]", "lists.weights=[1, 2.5, 1e-3]"])
    assert cfg.lists.backends == ["tensorboard", "jsonl", "wandb"] and cfg.lists.weights == [1.0, 2.5, 1e-3]
    path = write(tmp_path / "c.yaml", "lists:\n  backends:\n    - mlflow\n    - 'off'\n    - on\n")
    assert load_config(path).lists.backends == ["mlflow", "off", "on"]
    assert load_config(path, ["lists.backends=[]"]).lists.backends == []
    with pytest.raises(ConfigError, match=r"lists.backends.*a list of str"):
        load_config(None, ["lists.backends=tensorboard"])
    with pytest.raises(ConfigError, match=r"lists.weights.*a list of float"):
        load_config(None, ["lists.weights=[a, b]"])


@pytest.mark.parametrize("key", list(_list_keys()) or [pytest.param("", marks=pytest.mark.skip("no list keys"))])
def test_schema_list_keys_take_lists_from_command_line(key):
    default = config._get(Config(), key)
    cfg = load_config(None, [f"{key}=[{','.join(map(str, default))}]"])
    assert config._get(cfg, key) == default


def test_train_cli_reports_typo():
    proc = subprocess.run([sys.executable, "train.py", "trainer.max_stepz=1"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.max_stepz" in proc.stderr and "max_steps" in proc.stderr
