"""Two "nodes" × two processes on localhost through c10d rendezvous match one node of four, with
plain FSDP and with HSDP (one replica per node: parallel.replicate=0)."""

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


def _close(a, b):
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for x, y in zip(a, b):
        for k in ("loss/total", "loss/grad_norm", "perf/scored_tokens"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (k, x[k], y[k])


def test_two_nodes_match_one_node(tiny_model, clevr_parquet, tmp_path):
    single, multi, hsdp = tmp_path / "single", tmp_path / "multi", tmp_path / "hsdp"
    run_torchrun(sft_args(tiny_model, clevr_parquet, single, 2), nproc=4)
    # HSDP on one node: 2 replicas × 2 shards must train exactly like FSDP over 4
    proc = run_torchrun(sft_args(tiny_model, clevr_parquet, hsdp, 2, ["parallel.replicate=2"]), nproc=4)
    assert "2 replicas × 2 shards (HSDP)" in proc.stdout
    _close(rows(single), rows(hsdp))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                          "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "vlrl-test",
                          *sft_args(tiny_model, clevr_parquet, multi, 2, ["parallel.replicate=0"])],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    assert "2 replicas × 2 shards (HSDP)" in outs[0][0]  # node 0 holds rank 0, which logs
    a, b = rows(single), rows(multi)
    assert [r["step"] for r in b] == [1, 2]
    _close(a, b)
    assert json.loads((multi / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
