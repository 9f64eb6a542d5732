"""Two "nodes" × two processes on localhost through c10d rendezvous match one node of four."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_torchrun
from tests.test_sft_e2e import rows, sft_args

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_match_one_node(tiny_model, clevr_parquet, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_torchrun(sft_args(tiny_model, clevr_parquet, single, 2), nproc=4)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                          "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "vlrl-test", *sft_args(tiny_model, clevr_parquet, multi, 2)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    a, b = rows(single), rows(multi)
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        for k in ("loss/total", "loss/grad_norm", "perf/scored_tokens"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (k, x[k], y[k])
    assert json.loads((multi / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
