"""Nothing a checkpoint, dataset or model output holds is ever run as code.

A static scan of every Python file of the repository (AST, not text search) forbids unpickling,
`torch.load` without `weights_only=True`, eval/exec/compile, shells, unsafe YAML and
`trust_remote_code=True` defaults. Dynamic checks: a crafted checkpoint folder cannot run code
when loaded, and dataset text and paths are carried as data (never templated or interpolated).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from PIL import Image

from tests.conftest import ROOT

SKIP_DIRS = {".venv", "venv", ".git", "build", "dist", "runs", "artifacts", "node_modules", "__pycache__", ".eggs"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "jsonpickle"}
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("os", "execl"), ("os", "execlp"), ("os", "execv"), ("os", "execvp"),
               ("pty", "spawn"), ("commands", "getoutput")}
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}


def python_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out)


def _dotted(node: ast.AST) -> str:
    """`a.b.c` for a Name/Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _restricted_unpickler_classes(tree: ast.Module) -> set[str]:
    """Classes deriving from pickle.Unpickler that override find_class with a body that can raise."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_dotted(b) == "pickle.Unpickler" for b in node.bases):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "find_class" and any(
                    isinstance(n, ast.Raise) for n in ast.walk(item)
                ):
                    names.add(node.name)
    return names


def _pickle_problems(tree: ast.Module) -> list[tuple[int, str]]:
    """Pickle may only be imported to subclass Unpickler with a refusing find_class; nothing else of it is used."""
    problems = []
    imported = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    imported = True
                    if alias.name != "pickle" or alias.asname:
                        problems.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            problems.append((node.lineno, f"from {node.module} import ..."))
    if not imported:
        return problems
    safe = _restricted_unpickler_classes(tree)
    if not safe:
        problems.append((1, "imports pickle without a restricted Unpickler (find_class allowlist)"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _dotted(node.value) == "pickle" and node.attr not in (
            "Unpickler", "UnpicklingError"
        ):
            problems.append((node.lineno, f"pickle.{node.attr}"))
        if isinstance(node, ast.Call) and _dotted(node.func) == "pickle.Unpickler":
            problems.append((node.lineno, "unrestricted pickle.Unpickler(...)"))
    return problems


def _call_problems(call: ast.Call) -> list[str]:
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    out = []
    if isinstance(call.func, ast.Name) and call.func.id in ("eval", "exec", "compile"):
        out.append(f"{call.func.id}(...)")
    if isinstance(call.func, ast.Name) and call.func.id == "__import__" and not (
        call.args and isinstance(call.args[0], ast.Constant)
    ):  # importing a fixed module by name is harmless; a computed name is not
        out.append("__import__ of a computed name")
    if last == "load" and name.split(".")[0] == "torch" and not _is_true(_keyword(call, "weights_only")):
        out.append("torch.load without weights_only=True")
    if last in ("read_pickle", "unsafe_load") or (name in ("np.load", "numpy.load") and _is_true(_keyword(call, "allow_pickle"))):
        out.append(f"{name}(...) unpickles")
    if name == "yaml.load" and not (_dotted(_keyword(call, "Loader") or ast.Name("x")).endswith("SafeLoader")):
        out.append("yaml.load without SafeLoader")
    if tuple(name.rsplit(".", 1)) in SHELL_CALLS:
        out.append(f"{name}(...) runs a shell")
    if name.startswith("subprocess.") and last in SUBPROCESS_CALLS:
        if _is_true(_keyword(call, "shell")):
            out.append(f"{name}(..., shell=True)")
        first = call.args[0] if call.args else _keyword(call, "args")
        if isinstance(first, (ast.JoinedStr, ast.BinOp)) or (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            out.append(f"{name} with a command string (use an argument list)")
    if _is_true(_keyword(call, "trust_remote_code")):
        out.append("trust_remote_code=True")
    return out


def _default_problems(tree: ast.Module) -> list[tuple[int, str]]:
    """`trust_remote_code` defaulting to True, in a signature or a dataclass field."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            out += [(node.lineno, "trust_remote_code defaults to True") for a, d in pairs
                    if a.arg == "trust_remote_code" and _is_true(d)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                node.target.id == "trust_remote_code" and _is_true(node.value):
            out.append((node.lineno, "trust_remote_code field defaults to True"))
    return out


def scan(path: Path, root: Path = ROOT) -> list[str]:
    """Every forbidden pattern in one file, as 'file:line: what'."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = _pickle_problems(tree) + _default_problems(tree)
    found += [(n.lineno, p) for n in ast.walk(tree) if isinstance(n, ast.Call) for p in _call_problems(n)]
    rel = path.relative_to(root)
    return [f"{rel}:{line}: {what}" for line, what in sorted(found)]


# --- the scan --------------------------------------------------------------------------------
def test_scan_finds_the_project_files():
    names = {str(p.relative_to(ROOT)) for p in python_files()}
    assert {"train.py", "grpo/checkpoint.py", "data/datasets.py", "models/policy.py"} <= names
    assert not any(n.startswith(".venv") for n in names)


def test_no_unsafe_loading_eval_or_shell_anywhere():
    problems = [p for path in python_files() for p in scan(path)]
    assert problems == [], "\n".join(problems)


BAD_SNIPPETS = {
    "import pickle\nx = pickle.load(open('f', 'rb'))\n": "pickle",
    "import pickle\nclass U(pickle.Unpickler):\n    pass\nU(f).load()\n": "restricted Unpickler",
    "import dill\n": "import dill",
    "from pickle import loads\n": "from pickle",
    "import torch\ntorch.load('x.pt')\n": "weights_only",
    "import torch\ntorch.load('x.pt', weights_only=False)\n": "weights_only",
    "eval(text)\n": "eval(",
    "exec(code)\n": "exec(",
    "__import__(name)\n": "computed name",
    "import os\nos.system(f'ls {path}')\n": "runs a shell",
    "import subprocess\nsubprocess.run(cmd, shell=True)\n": "shell=True",
    "import subprocess\nsubprocess.run(f'cat {path}')\n": "command string",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)\n": "SafeLoader",
    "import numpy as np\nnp.load(p, allow_pickle=True)\n": "unpickles",
    "def f(path, trust_remote_code=True):\n    pass\n": "defaults to True",
    "class C:\n    trust_remote_code: bool = True\n": "defaults to True",
    "AutoModel.from_pretrained(p, trust_remote_code=True)\n": "trust_remote_code=True",
}


@pytest.mark.parametrize("snippet", list(BAD_SNIPPETS), ids=list(BAD_SNIPPETS.values()))
def test_the_scan_catches_each_pattern(snippet, tmp_path):
    """The scan is only worth something if it fires: each forbidden pattern, planted in a file."""
    bad = tmp_path / "bad.py"
    bad.write_text(snippet)
    found = scan(bad, tmp_path)
    assert any(BAD_SNIPPETS[snippet] in p for p in found), found


def test_the_scan_allows_safe_forms(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("import torch, subprocess, yaml\nmodel.eval()\ntorch.load(p, weights_only=True)\n"
                  "subprocess.run([sys.executable, '-m', 'x', str(path)])\nyaml.safe_load(t)\n"
                  "def f(trust_remote_code=False):\n    pass\nroot = __import__('pathlib').Path('.')\n")
    assert scan(ok, tmp_path) == []


# --- defaults ----------------------------------------------------------------------------------
def test_trust_remote_code_is_off_by_default_and_in_every_shipped_config():
    import yaml

    from grpo.config import Config, load_config

    assert Config().model.trust_remote_code is False
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert load_config(str(path)).model.trust_remote_code is False, path
        assert "trust_remote_code" not in str(yaml.safe_load(path.read_text()).get("model") or {}) or \
            yaml.safe_load(path.read_text())["model"]["trust_remote_code"] is False, path


# --- a crafted checkpoint cannot run code -------------------------------------------------------
class _Planted:
    """An object whose unpickling would create a directory: the evidence that code ran."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def _small_checkpoint(folder: Path, extra=None) -> dict:
    state = {"model": {"weight": torch.arange(6.0).reshape(2, 3)}}
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_crafted_checkpoint_metadata_is_refused_without_running_it(tmp_path):
    from grpo.checkpoint import load_dcp

    folder = tmp_path / "step_1"
    _small_checkpoint(folder)
    evidence = tmp_path / "ran"
    # protocol-0 pickle: call os.mkdir(evidence) — what plain pickle.load of .metadata would do
    (folder / ".metadata").write_bytes(b"cos\nmkdir\n(V" + str(evidence).encode() + b"\ntR.")
    with pytest.raises(RuntimeError, match=r"step_1.*os\.mkdir.*refusing to load"):
        load_dcp({"model": {"weight": torch.zeros(2, 3)}}, folder, no_dist=True)
    assert not evidence.exists()


def test_crafted_non_tensor_item_is_refused_without_running_it(tmp_path):
    from grpo.checkpoint import load_dcp

    folder, evidence = tmp_path / "step_1", tmp_path / "ran"
    _small_checkpoint(folder, extra=_Planted(str(evidence)))
    assert not evidence.exists()
    with pytest.raises(RuntimeError, match="step_1.*[Ww]eights only load failed"):
        load_dcp({"model": {"weight": torch.zeros(2, 3)}, "extra": None}, folder, no_dist=True)
    assert not evidence.exists()


def test_real_checkpoint_still_loads_through_the_safe_reader(tmp_path):
    from grpo.checkpoint import load_dcp

    folder = tmp_path / "step_1"
    saved = _small_checkpoint(folder, extra={"lr": 0.5, "betas": (0.9, 0.99), "fused": None})
    state = {"model": {"weight": torch.zeros(2, 3)}, "extra": {"lr": 0.0, "betas": None, "fused": False}}
    load_dcp(state, folder, no_dist=True)
    assert torch.equal(state["model"]["weight"], saved["model"]["weight"])
    assert state["extra"] == {"lr": 0.5, "betas": (0.9, 0.99), "fused": None}


# --- dataset text and paths are data ------------------------------------------------------------
def test_dataset_text_is_never_templated(tiny_model):
    from data.datasets import Sample
    from data.processing import encode_prompt, load_processor

    processor = load_processor(str(tiny_model))
    text = "{{ 7 * 7 }} {% for i in range(3) %}Z{% endfor %} {{ raise_exception('x') }} <image>"
    sample = Sample(index=0, images=[Image.new("RGB", (56, 56), (9, 9, 9))], problem=text, answer="1")
    prompt = encode_prompt(processor, sample, "clevr", 4096)
    decoded = processor.tokenizer.decode(prompt.input_ids)
    assert "{{ 7 * 7 }}" in decoded and "{% for i in range(3) %}Z{% endfor %}" in decoded
    assert "49" not in decoded and "ZZZ" not in decoded


def test_paths_are_taken_literally(tmp_path):
    from grpo.config import load_config
    from grpo.checkpoint import resolve_resume

    evidence = tmp_path / "ran"
    odd = f"{tmp_path}/$(mkdir {evidence})/`mkdir {evidence}`/${{HOME}}/%(x)s"
    given = odd.replace("${", "\\${")  # the config expands only ${section.key}; \${ is a literal ${
    cfg = load_config(None, [f"trainer.run_dir={given}", f"checkpoint.resume={given}/step_1",
                             f"data.train_path={given}/d.parquet"])
    assert cfg.trainer.run_dir == odd and cfg.data.train_path == f"{odd}/d.parquet"
    with pytest.raises(FileNotFoundError, match=r"\$\(mkdir"):
        resolve_resume(cfg.checkpoint.resume, cfg.trainer.run_dir)
    from data.datasets import VLDataset

    with pytest.raises(FileNotFoundError, match=r"\$\{HOME\}"):
        VLDataset(cfg.data.train_path, "clevr")
    assert not evidence.exists()
