"""tools/checkpoint_merge.py writes only where nothing of a run or of a user can be lost.

It never writes inside a run folder, replaces with --overwrite only a folder an earlier merge wrote
(it carries .vlrl-merge.json), gives its files the umask's permissions, and answers `--out .`,
`..` and `/` with one line. One tiny checkpoint, saved once on a one-rank gloo group, serves all.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from grpo.checkpoint import save_checkpoint, verify_checkpoint
from grpo.config import ModelConfig, OptimConfig
from grpo.update import build_optimizer
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy
from tools.checkpoint_merge import MARKER
from tools.checkpoint_merge import main as merge_main


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> Path:
    """A run folder as the trainer leaves it: config, metrics, TensorBoard logs and one checkpoint."""
    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-3))
    run = tmp_path_factory.mktemp("merge") / "run"
    save_checkpoint(run, 1, policy.model, optimizer, {"data": {}, "counters": {}}, str(tiny_model))
    (run / "config.yaml").write_text("trainer: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")
    return run


def merge(run: Path, out, *extra: str) -> int:
    return merge_main(["--checkpoint", str(run / "checkpoints" / "step_1"), "--out", str(out), *extra])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_out_inside_a_run_folder_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other_run"  # another run's folder: a resume checkpoint and TensorBoard logs
    (other / "checkpoints" / "step_5").mkdir(parents=True)
    (other / "checkpoints" / "latest").write_text("step_5\n")
    (other / "tensorboard").mkdir()
    tensorboard_link = tmp_path / "tb"
    tensorboard_link.symlink_to(run / "tensorboard")
    for out in (run / "tensorboard", run / "merged", run / "checkpoints" / "step_0", run / "checkpoints" / "step_1",
                run, other / "checkpoints" / "step_5", other / "tensorboard", other / "hf", tensorboard_link):
        assert merge(run, out, "--overwrite") == 2, out
        assert "run folder" in one_line_error(capsys) or out in (run, run / "checkpoints" / "step_1")
    assert (run / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"events"
    assert not (run / "merged").exists() and not (run / "checkpoints" / "step_0").exists()
    assert not (other / "hf").exists() and (other / "checkpoints" / "step_5").is_dir()
    assert verify_checkpoint(run / "checkpoints" / "step_1")["files"] > 0


def test_overwrite_replaces_only_a_folder_a_merge_wrote(run, tmp_path, capsys):
    mine = tmp_path / "my_model"  # a user's folder of unrelated files
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "notes.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        assert merge(run, mine, *extra) == 2
        assert "config.json, notes.txt" in one_line_error(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    assert (mine / "config.json").read_text() == '{"mine": true}'

    out = tmp_path / "new" / "model"
    assert merge(run, out) == 0
    written = json.loads((out / MARKER).read_text())
    assert written["files"] == sorted(p.name for p in out.iterdir() if p.name != MARKER)
    assert "model.safetensors" in written["files"] and "config.json" in written["files"]
    assert merge(run, out) == 2  # not empty, no --overwrite
    assert "--overwrite" in one_line_error(capsys)
    before = (out / "model.safetensors").stat().st_ino
    assert merge(run, out, "--overwrite") == 0 and (out / "model.safetensors").stat().st_ino != before
    (out / "notes.txt").write_text("added by hand")
    assert merge(run, out, "--overwrite") == 2
    assert "also holds 1 entries: notes.txt" in one_line_error(capsys)
    assert (out / "notes.txt").read_text() == "added by hand"
    assert not [p.name for p in out.parent.iterdir() if p.name != "model"], "temporary folders were left"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert merge(run, empty) == 0 and (empty / MARKER).is_file()


def test_merged_files_follow_the_umask(run, tmp_path):
    previous = os.umask(0o002)
    try:
        assert merge(run, tmp_path / "hf") == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == 0o664 and set(modes.values()) == {0o664}, modes
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o775


def test_out_dot_dotdot_and_root_are_one_line_errors(run, tmp_path, monkeypatch, capsys):
    here = tmp_path / "work" / "empty"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for out in (".", "..", "/", ""):
        assert merge(run, out) == 2, out
        assert "the current folder or one holding it" in one_line_error(capsys)
    assert not list(here.iterdir()) and sorted(p.name for p in here.parent.iterdir()) == ["empty"]


def test_a_damaged_checkpoint_is_not_merged(run, tmp_path, capsys):
    shard = next((run / "checkpoints" / "step_1").glob("__0_*.distcp"))
    kept = shard.read_bytes()
    data = bytearray(kept)
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    try:
        assert merge(run, tmp_path / "out") == 2
        assert shard.name in one_line_error(capsys)
        assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    finally:
        shard.write_bytes(kept)
