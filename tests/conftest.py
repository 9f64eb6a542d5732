"""Shared fixtures: a tiny model folder and small generated datasets, built once per session, offline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or end-to-end tests")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tools.make_tiny_model import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen2_5_vl", family="qwen2_5_vl",
                                size="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    """The tiny Qwen3.5-MoE (test_family_qwen3_5, test_moe_*)."""
    from tools.make_tiny_model import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen3_5_moe", family="qwen3_5_moe",
                                size="tiny", seed=0))


@pytest.fixture(scope="session")
def clevr_parquet(tmp_path_factory) -> Path:
    from tools.make_dataset import make_dataset

    return Path(make_dataset("clevr", 48, 0, tmp_path_factory.mktemp("data") / "clevr.parquet",
                             size=(56, 56), max_objects=4))


def run_torchrun(args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node N train.py ARGS` from the repo root; fail with its output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        # the first rank to fail often reports above the tail the others fill with their own errors: its lines
        # that name an error or a signal, wherever they are
        first = [line for line in proc.stderr.splitlines()
                 if re.search(r"error|exception|terminate called|what\(\)|fatal|signal|exitcode", line, re.I)][:40]
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\nerror lines:\n"
                             + "\n".join(first) + f"\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc
