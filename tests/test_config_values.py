"""Config values mean what they say: every documented value works from YAML and the command line,
nothing is silently dropped, ranges are checked at load and bad YAML names the file and line."""

import dataclasses
import typing
from pathlib import Path

import pytest

import grpo.config as config
from grpo.config import Config, ConfigError, load_config, parse_override


def _literal_keys(cls=Config, prefix=""):
    """(dotted key, allowed values) of every string-enum key of the schema, found by introspection."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _literal_keys(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is typing.Literal:
            yield f"{prefix}{f.name}", typing.get_args(tp)


LITERAL_VALUES = [(key, value) for key, values in _literal_keys() for value in values]


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _yaml_for(key: str, value_text: str) -> str:
    section, name = key.rsplit(".", 1)
    return f"{section}:\n  {name}: {value_text}\n"


def test_the_schema_has_string_enum_keys_with_on_and_off():
    assert len(LITERAL_VALUES) >= 20
    assert ("parallel.offload_during_generate", "off") in LITERAL_VALUES
    assert ("parallel.offload_during_generate", "on") in LITERAL_VALUES


@pytest.mark.parametrize("key,value", LITERAL_VALUES, ids=[f"{k}={v}" for k, v in LITERAL_VALUES])
def test_every_enum_value_from_command_line(key, value):
    assert _get(load_config(None, [f"{key}={value}"]), key) == value
    assert _get(load_config(None, [f"{key}='{value}'"]), key) == value


@pytest.mark.parametrize("key,value", LITERAL_VALUES, ids=[f"{k}={v}" for k, v in LITERAL_VALUES])
def test_every_enum_value_from_yaml(key, value, tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text(_yaml_for(key, value))
    assert _get(load_config(str(plain)), key) == value
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text(_yaml_for(key, f'"{value}"'))
    assert _get(load_config(str(quoted)), key) == value


@pytest.mark.parametrize("word", ["on", "off", "yes", "no", "On", "OFF", "Yes", "NO"])
def test_yaml_11_boolean_words_stay_strings(word):
    assert parse_override(f"a={word}") == {"a": word}


@pytest.mark.parametrize("word,meaning", [("true", True), ("false", False), ("yes", True), ("no", False),
                                          ("on", True), ("off", False), ("True", True), ("FALSE", False)])
def test_bool_keys_accept_true_false_yes_no_on_off(word, meaning, tmp_path):
    assert load_config(None, [f"logging.tensorboard={word}"]).logging.tensorboard is meaning
    path = tmp_path / "c.yaml"
    path.write_text(f"logging:\n  tensorboard: {word}\n")
    assert load_config(str(path)).logging.tensorboard is meaning


def test_enum_key_rejects_a_boolean():
    with pytest.raises(ConfigError, match=r"parallel.offload_during_generate.*one of 'auto', 'on', 'off'.*True"):
        load_config(None, ["parallel.offload_during_generate=true"])


# --- nothing silently dropped ----------------------------------------------------------------------

def test_duplicate_section_in_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  max_steps: 3\nrollout:\n  n: 2\ntrainer:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"dup.yaml, line 5.*'trainer' is given twice \(first on line 1\)"):
        load_config(str(path))


def test_duplicate_key_inside_a_section_and_in_a_base(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("optim:\n  lr: 1.0e-6\n  warmup_steps: 2\n  lr: 3.0e-6\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base.yaml, line 4.*'lr' is given twice \(first on line 2\)"):
        load_config(str(child))


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("trainer:\n  <<: {max_steps: 3, seed: 1}\n  seed: 2\n")
    cfg = load_config(str(path))
    assert (cfg.trainer.max_steps, cfg.trainer.seed) == (3, 2)


@pytest.mark.parametrize("raw,kept", [
    ("runs/a #1", "runs/a #1"),
    ("runs/a  # not a comment", "runs/a  # not a comment"),
    ("#first", "#first"),
    ("'quoted #kept'", "quoted #kept"),
    ("runs/a#1", "runs/a#1"),
])
def test_hash_in_command_line_value_is_kept_verbatim(raw, kept):
    assert load_config(None, [f"trainer.run_dir={raw}"]).trainer.run_dir == kept


def test_hash_in_a_number_is_an_error_that_says_why():
    with pytest.raises(ConfigError, match=r"trainer.max_steps.*'5 #steps'.*kept whole"):
        load_config(None, ["trainer.max_steps=5 #steps"])


# --- bad YAML names the file and line ----------------------------------------------------------------

@pytest.mark.parametrize("text,line", [
    ("trainer:\n  max_steps: 3\n   seed: 1\n", 3),
    ("trainer:\n  run_dir: [runs\nmodel:\n  path: x\n", 3),
    ("trainer:\n\tmax_steps: 3\n", 2),
    ("rollout:\n  n: 2\n  engine: 'torch\n", 4),
])
def test_yaml_syntax_error_names_file_and_line(text, line, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"broken.yaml, line {line}, column \d+: not valid YAML"):
        load_config(str(path))


def test_non_mapping_and_binary_files(tmp_path):
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping"):
        load_config(str(listing))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"trainer:\n  run_dir: \xff\xfe\n")
    with pytest.raises(ConfigError, match="bin.yaml is not UTF-8"):
        load_config(str(binary))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_bad_yaml_on_the_command_line_names_the_override():
    with pytest.raises(ConfigError, match=r"command-line override 'trainer.run_dir=\[a'.*not valid YAML"):
        load_config(None, ["trainer.run_dir=[a"])


# --- ranges at load ------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", config.AT_LEAST_ONE)
def test_counts_must_be_at_least_one(key):
    with pytest.raises(ConfigError, match=rf"'{key}' must be >= 1, got 0"):
        load_config(None, [f"{key}=0"])
    load_config(None, [f"{key}=1"] + (["data.min_pixels=1"] if key == "data.max_pixels" else []))


@pytest.mark.parametrize("key", config.AT_LEAST_ZERO)
def test_non_negative_values(key):
    with pytest.raises(ConfigError, match=rf"'{key}' must be >= 0, got -1"):
        load_config(None, [f"{key}=-1"])


@pytest.mark.parametrize("key", config.PROBABILITIES + ("rollout.gpu_memory_utilization",))
@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_probabilities_in_unit_interval(key, value):
    with pytest.raises(ConfigError, match=rf"'{key}' must be in \(0, 1\]"):
        load_config(None, [f"{key}={value}"])
    assert _get(load_config(None, [f"{key}=1"]), key) == 1.0


def test_top_p_zero_is_rejected_and_memory_share_zero_means_plan():
    with pytest.raises(ConfigError, match=r"'rollout.top_p' must be in \(0, 1\], got 0"):
        load_config(None, ["rollout.top_p=0"])
    assert load_config(None, ["rollout.gpu_memory_utilization=0"]).rollout.gpu_memory_utilization == 0.0


def test_temperature_must_be_positive_for_grpo_only():
    for value in ("0", "0.0"):
        with pytest.raises(ConfigError, match=r"'rollout.temperature' must be > 0 for GRPO"):
            load_config(None, ["trainer.mode=grpo", f"rollout.temperature={value}"])
    assert load_config(None, ["trainer.mode=sft", "rollout.temperature=0"]).rollout.temperature == 0.0
    with pytest.raises(ConfigError, match=r"'rollout.temperature' must be >= 0"):
        load_config(None, ["trainer.mode=sft", "rollout.temperature=-1"])


@pytest.mark.parametrize("override,message", [
    ("rollout.top_k=0", r"'rollout.top_k' must be -1 \(off\) or >= 1"),
    ("rollout.top_k=-2", r"'rollout.top_k' must be -1 \(off\) or >= 1"),
    ("optim.beta2=1", r"'optim.beta2' must be in \[0, 1\)"),
    ("optim.eps=0", r"'optim.eps' must be > 0"),
    ("optim.min_lr_ratio=2", r"'optim.min_lr_ratio' must be in \[0, 1\]"),
    ("parallel.replicate=-1", r"'parallel.replicate' must be 0 \(one replica per node\) or positive"),
    ("data.min_pixels=99999999", r"'data.min_pixels' \(99999999\) must be <= data.max_pixels"),
    ("rollout.temperature=.inf", r"'rollout.temperature' must be a finite number"),
    ("algorithm.kl_coef=.nan", r"'algorithm.kl_coef' must be a finite number"),
])
def test_other_ranges(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_shipped_configs_are_in_range():
    for path in sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")):
        config.validate(load_config(str(path)))


@dataclasses.dataclass
class _Switches:
    answer: typing.Literal["yes", "no", "ask"] = "ask"
    power: typing.Literal["on", "off", "auto"] = "auto"


@dataclasses.dataclass
class _ConfigWithSwitches(Config):
    switches: _Switches = dataclasses.field(default_factory=_Switches)


@pytest.mark.parametrize("key,value", [("switches.answer", "yes"), ("switches.answer", "no"),
                                       ("switches.power", "on"), ("switches.power", "off")])
def test_yes_no_on_off_enum_values_from_command_line_and_yaml(key, value, tmp_path, monkeypatch):
    monkeypatch.setattr(config, "Config", _ConfigWithSwitches)
    assert _get(load_config(None, [f"{key}={value}"]), key) == value
    path = tmp_path / "c.yaml"
    path.write_text(_yaml_for(key, value))
    assert _get(load_config(str(path)), key) == value
