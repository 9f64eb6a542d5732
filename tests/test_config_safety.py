"""The config reads only the config: no environment variable or resolver is ever expanded, on any path,
and no YAML (aliases, nesting, size) can exhaust memory or the stack. A bad dtype in the model's
config.json is a one-line error at start."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import grpo.config as config
from grpo.config import ConfigError, load_config, save_config

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret-vlrl-value"
B = "\\"

# Each reaches the environment (or a resolver) through OmegaConf unless refused; the second is an escaped
# backslash followed by a live interpolation, the next ones nest a resolver inside another's default.
RESOLVER_VALUES = [
    "${oc.env:VLRL_SECRET}",
    B * 2 + "${oc.env:VLRL_SECRET}",
    "a" + B * 4 + "${oc.env:VLRL_SECRET}",
    "${oc.select:trainer.nope,${oc.env:VLRL_SECRET}}",
    "${oc.env:VLRL_NOT_SET,${oc.env:VLRL_SECRET}}",
    "${oc.decode:${oc.env:VLRL_SECRET}}",
    "${oc.decode:'${oc.env:VLRL_SECRET}'}",
    "runs/${trainer.seed}/${oc.env:VLRL_SECRET}",
    "${trainer.${oc.env:VLRL_SECRET}}",
    "${vlrl_probe:}",
    "${HOME}",
    "${VLRL_SECRET}",
]


@pytest.fixture
def probe(monkeypatch):
    """The secret in the environment, and a resolver that records every call."""
    monkeypatch.setenv("VLRL_SECRET", SECRET)
    calls = []
    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver  # 2.4 renamed it
    register("vlrl_probe", lambda *a: calls.append(a) or SECRET, replace=True)
    yield calls
    OmegaConf.clear_resolver("vlrl_probe")


def _refused(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert SECRET not in message and "\n" not in message
    return message


@pytest.mark.parametrize("value", RESOLVER_VALUES)
def test_command_line_resolvers_are_refused_naming_the_key(probe, value):
    message = _refused([f"model.path={value}"])
    assert "'model.path'" in message and "never an environment variable or a resolver" in message
    message = _refused([f"model.lora.targets=[q_proj, {json.dumps(value)}]"])
    assert "'model.lora.targets'" in message
    message = _refused([f"model.lora.targets=[[x, [{{k: {json.dumps(value)}}}]]]"])  # deeper than the type allows
    assert "'model.lora.targets'" in message
    message = _refused([f"model.lora.targets=!!omap [{{k: {json.dumps(value)}}}]"])  # a list of tuples
    assert "'model.lora.targets'" in message and "never an environment variable" in message
    assert probe == []


@pytest.mark.parametrize("value", RESOLVER_VALUES[:6])
def test_yaml_and_base_file_resolvers_are_refused(tmp_path, probe, value):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"data": {"train_path": value}}))
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ntrainer:\n  seed: 3\n")
    message = _refused(path=str(child))
    assert "'data.train_path'" in message and "base.yaml" in message
    assert probe == []


def test_literal_text_stays_literal_and_never_resolves_later(tmp_path, probe):
    literal = B + "${oc.env:VLRL_SECRET}"
    cfg = load_config(None, [f"data.train_path={literal}", "model.path=${data.train_path}",
                             "data.eval_path=x/${data.train_path}/" + B * 3 + "${vlrl_probe:}"])
    assert cfg.data.train_path == cfg.model.path == "${oc.env:VLRL_SECRET}"
    assert cfg.data.eval_path == "x/${oc.env:VLRL_SECRET}/" + B + "${vlrl_probe:}"
    save_config(cfg, tmp_path / "config.yaml")
    assert SECRET not in (tmp_path / "config.yaml").read_text()
    assert load_config(str(tmp_path / "config.yaml")) == cfg
    assert probe == []


@pytest.mark.parametrize("text", [B + "${x}", "a" + B * 2 + "${x}", B * 3 + "${y}/" + B, "x" + B, "$" + B + "{z}"])
def test_saved_backslashes_before_interpolations_round_trip(tmp_path, text):
    cfg = load_config(None, [])
    cfg.data.train_path = text
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")).data.train_path == text


def test_key_references_still_resolve():
    cfg = load_config(None, ["trainer.run_dir=runs/${data.task}_${trainer.seed}", "trainer.seed=4",
                             "trainer.eval_every=${checkpoint.every_steps}", "checkpoint.every_steps=2"])
    assert cfg.trainer.run_dir == "runs/clevr_4" and cfg.trainer.eval_every == 2


def test_long_values_give_short_errors_quickly():
    start = time.perf_counter()
    for value in ("${trainer.seed}" * 5000, "${oc.select:" * 3000 + "}" * 3000, "${" + "a." * 20000 + "b}"):
        assert len(_refused([f"model.path={value}"])) < 1000
    assert len(_refused(["model.lora.targets=" + "x" * 100_000])) < 1000  # a type error quotes the value, cut
    assert time.perf_counter() - start < 10
    assert load_config(None, ["model.path=" + "${trainer.seed}/" * 32]).model.path == "0/" * 32


def _billion_laughs(levels: int = 9) -> str:
    first = '&x0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    rest = [f"&x{i} [" + ",".join([f"*x{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "model:\n  lora:\n    targets: [" + ", ".join([first, *rest]) + "]\n"


def test_billion_laughs_is_a_one_line_error_in_bounded_memory(tmp_path):
    """Run apart, under a 1 GiB address-space limit: before the check this grew to gigabytes."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_billion_laughs())
    assert path.stat().st_size < 500
    script = textwrap.dedent(f"""
        import resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from grpo.config import ConfigError, load_config
        start = time.perf_counter()
        for args in ({str(path)!r}, []), (None, ["model.lora.targets=" + {_billion_laughs()!r}.split("targets: ")[1]]):
            try:
                load_config(*args)
            except ConfigError as exc:
                print("ConfigError", time.perf_counter() - start, exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stderr[-2000:]
    assert all("expands to more than" in line for line in lines)
    assert float(lines[-1].split()[1]) < 10


def test_deep_nesting_is_a_one_line_error(tmp_path):
    deep = "[" * 10_000 + "]" * 10_000
    path = tmp_path / "deep.yaml"
    path.write_text(f"model:\n  lora:\n    targets: {deep}\n")
    block = tmp_path / "block.yaml"
    block.write_text("model:\n  lora:\n    targets:\n" + "".join(" " * (4 + 2 * i) + "-\n" for i in range(600)))
    start = time.perf_counter()
    for message in (_refused(path=str(path)), _refused(path=str(block)), _refused([f"model.lora.targets={deep}"])):
        assert f"nested more than {config.MAX_YAML_DEPTH} levels" in message
    assert time.perf_counter() - start < 30


def test_alias_limits(tmp_path):
    assert "contain itself" in _refused(["model.lora.targets=&a [*a]"])
    assert "expands to more than" in _refused(["model.lora.targets=[" + ",".join(["q"] * 10_001) + "]"])
    path = tmp_path / "anchors.yaml"  # ordinary anchors still work
    path.write_text("model:\n  lora:\n    targets: &t [q_proj, v_proj]\n    vision_targets: *t\n")
    cfg = load_config(str(path))
    assert cfg.model.lora.targets == cfg.model.lora.vision_targets == ["q_proj", "v_proj"]


def test_oversized_config_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("trainer:\n  seed: 1\n" + "#" * config.MAX_YAML_BYTES + "\n")
    message = _refused(path=str(path))
    assert "big.yaml" in message and f"at most {config.MAX_YAML_BYTES}" in message
    path.write_text("trainer:\n  seed: 1\n" + "# comment\n" * 1000)
    assert load_config(str(path)).trainer.seed == 1


# --- the model's config.json ---------------------------------------------------------------------------

def _model_copy(src: Path, dst: Path, **changes) -> Path:
    """`src` with config.json changed: its other files are links to the original."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    data = json.loads((src / "config.json").read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("change", [{"dtype": "float33"}, {"torch_dtype": "torch.bfloat16"},
                                    {"text_config__dtype": "int8"}, {"vision_config__torch_dtype": 16}])
def test_bad_model_dtype_fails_at_start_in_one_line(tiny_model, tmp_path, change):
    from grpo.preflight import preflight
    from models.policy import load_model_config

    folder = _model_copy(tiny_model, tmp_path / "m", **change)
    (key, value), = change.items()
    with pytest.raises(ConfigError) as info:
        preflight(load_config(None, [f"model.path={folder}"]))
    message = str(info.value)
    assert "config.json" in message and repr(value) in message and key.replace("__", ".") in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"config\.json.*not a torch floating-point dtype"):
        load_model_config(str(folder))


def test_good_model_dtypes_pass_the_model_check(tiny_model, tmp_path):
    from grpo.preflight import preflight

    folder = _model_copy(tiny_model, tmp_path / "m", dtype="bfloat16", text_config__torch_dtype="float16",
                         vision_config__dtype=None)
    with pytest.raises(ConfigError, match="data.train_path"):  # past the model folder, on to the data
        preflight(load_config(None, [f"model.path={folder}"]))
    assert os.path.islink(folder / "model.safetensors")


def test_deeply_nested_model_config_json_is_one_line(tiny_model, tmp_path):
    from grpo.preflight import preflight

    folder = _model_copy(tiny_model, tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "qwen2_5_vl", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(maximum recursion depth") as info:
        preflight(load_config(None, [f"model.path={folder}"]))
    assert "\n" not in str(info.value)
