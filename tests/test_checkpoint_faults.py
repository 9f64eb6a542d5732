"""Crash safety of resume checkpoints: kill -9 at each write phase, a full disk, what resume=auto picks.

The kill tests run the real trainer under torchrun (2 ranks, tiny model, SFT) with the test hook
VLRL_FAULT_AT=PHASE@STEP, which SIGKILLs the process at that phase of that step's save. The
disk-full and folder-scanning tests run in-process on a one-rank gloo group.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

import grpo.checkpoint as ckpt
from grpo.checkpoint import FAULT_ENV, FAULT_PHASES, find_latest, load_checkpoint, save_checkpoint
from grpo.config import ModelConfig, OptimConfig
from grpo.update import build_optimizer
from models.parallel import build_parallel_dims, init_distributed
from models.policy import build_policy
from tests.conftest import ROOT

COMPARED = ("loss/total", "loss/grad_norm", "optim/lr", "perf/tokens")


# --- helpers ---------------------------------------------------------------------------------
def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file in a checkpoint folder, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def full_weights(model) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in model.state_dict().items()}


def sft_args(model, data, run_dir, steps, extra=()):
    return ["train.py", "--config", "configs/sft_clevr_tiny.yaml", f"model.path={model}", f"data.train_path={data}",
            f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", "data.prompts_per_step=4",
            "data.shuffle=false", "logging.tensorboard=false", "trainer.progress=false", *extra]


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun with 2 ranks in its own session, so whatever a killed run leaves behind can be ended by group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call created: leftovers of a killed run
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# --- kill -9 during checkpoint writes (torchrun, 2 ranks) ------------------------------------
def _check_after_kill(run: Path, phase: str, step1_digest: dict) -> None:
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_1", phase
    assert digest(root / "step_1") == step1_digest, f"{phase}: the previous checkpoint changed"
    assert find_latest(run) == root / "step_1", phase
    if phase == "after_rename":  # complete and renamed, but not yet named by `latest`
        assert ckpt.is_complete(root / "step_2") and not (root / "step_2.tmp").exists()
    else:
        assert (root / "step_2.tmp").is_dir() and not (root / "step_2").exists(), phase


@pytest.mark.slow
def test_kill9_at_every_write_phase_then_resume_exactly(tiny_model, clevr_parquet, tmp_path):
    """Each run is killed while saving step 2 (a different phase each time) and the next one resumes
    from step 1. The first run's row for step 2 was computed without any resume, so every later
    row for step 2 must equal it exactly; a last run without a fault completes the save."""
    run = tmp_path / "run"
    args = sft_args(tiny_model, clevr_parquet, run, 2, ["checkpoint.every_steps=1", "checkpoint.keep=3"])
    reference, step1 = None, None
    for phase in FAULT_PHASES:
        proc = launch(args, env={FAULT_ENV: f"{phase}@2"})
        assert proc.returncode != 0, f"{phase}: the run was not killed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        rows = metric_rows(run)
        assert [r["step"] for r in rows] == [1, 2], (phase, proc.stderr[-3000:])
        if reference is None:
            reference, step1 = rows, digest(run / "checkpoints" / "step_1")
            assert "resumed from" not in proc.stdout
        else:
            assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in proc.stdout, phase
            for k in COMPARED:
                assert rows[1][k] == reference[1][k], (phase, k, rows[1][k], reference[1][k])
        _check_after_kill(run, phase, step1)

    proc = launch(args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for k in COMPARED:
        assert rows[1][k] == reference[1][k], (k, rows[1][k], reference[1][k])
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_2" and find_latest(run) == root / "step_2"
    assert not list(root.glob("*.tmp")), "stale temporary folders were not removed"
    assert digest(root / "step_1") == step1


# --- in-process: full disk, folder scanning ---------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_model):
    """A one-rank policy and an optimizer with state (one step taken)."""
    init_distributed()
    policy = build_policy(ModelConfig(path=str(tiny_model)), build_parallel_dims())
    optimizer = build_optimizer(policy, OptimConfig(lr=1e-3))
    nudge(policy, optimizer)
    return policy, optimizer


def nudge(policy, optimizer) -> None:
    """One optimizer step with a fixed gradient, so weights and Adam moments change."""
    for p in policy.model.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def save(run: Path, step: int, trained, model_path, keep: int = 2) -> Path:
    policy, optimizer = trained
    return save_checkpoint(run, step, policy.model, optimizer, {"data": {"step_seen": step}, "counters": {}},
                           str(model_path), keep=keep)


def _disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_disk_full_while_writing_shards(trained, tiny_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = save(run, 1, trained, tiny_model)
    kept, weights = digest(first), full_weights(trained[0].model)
    nudge(*trained)
    real = FileSystem.create_stream

    def full(self, path, mode):
        if "w" in mode:
            raise _disk_full(path)
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full)
    with pytest.raises(OSError) as info:
        save(run, 2, trained, tiny_model)
    monkeypatch.undo()
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(run / "checkpoints" / "step_2.tmp") in message and "No space left" in message
    assert f"previous checkpoint {first} is intact" in message
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1" and find_latest(run) == first
    assert digest(first) == kept
    assert not (run / "checkpoints" / "step_2.tmp").exists(), "the partial folder was left on a full disk"
    # the kept checkpoint still restores the weights it was written with
    state = load_checkpoint(first, trained[0].model, trained[1])
    assert state["step"] == 1 and state["data"] == {"step_seen": 1}
    restored = full_weights(trained[0].model)
    assert all(torch.equal(restored[k], weights[k]) for k in weights)
    # and once there is space again, the next save goes through
    second = save(run, 2, trained, tiny_model)
    assert find_latest(run) == second and (run / "checkpoints" / "latest").read_text().strip() == "step_2"


def test_disk_full_while_writing_trainer_state(trained, tiny_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = save(run, 1, trained, tiny_model)
    kept = digest(first)
    real = ckpt._write_durable

    def full(path, text):
        if Path(path).name == "trainer_state.json":
            raise _disk_full(path)
        return real(path, text)

    monkeypatch.setattr(ckpt, "_write_durable", full)
    with pytest.raises(OSError, match=r"step_2\.tmp failed: No space left on device writing \S+/step_2\.tmp/"
                                      r"trainer_state\.json; .*step_1 is intact"):
        save(run, 2, trained, tiny_model)
    assert find_latest(run) == first and digest(first) == kept
    assert not (run / "checkpoints" / "step_2").exists() and not (run / "checkpoints" / "step_2.tmp").exists()


def test_find_latest_skips_incomplete_folders_and_bad_pointers(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    good = save(run, 1, trained, tiny_model, keep=0)
    root = run / "checkpoints"
    for name, drop in (("step_5.tmp", None), ("step_3", ".metadata"), ("step_4", "trainer_state.json")):
        (root / name).mkdir()
        for f in good.iterdir():
            if f.name != drop:
                (root / name / f.name).write_bytes(f.read_bytes())
    assert find_latest(run) == good  # step_3/4 lack a file, step_5.tmp was never finished
    for pointer in ("step_4", "../../../etc", "step_5.tmp", ""):
        (root / "latest").write_text(pointer + "\n")
        assert find_latest(run) == good, pointer
    (root / "latest").unlink()
    assert find_latest(run) == good
    assert ckpt.resolve_resume("auto", run) == good and ckpt.resolve_resume("never", run) is None
    with pytest.raises(FileNotFoundError, match="step_4"):
        ckpt.resolve_resume(str(root / "step_4"), run)


def test_next_save_removes_stale_temporaries_and_prunes(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (1, 2):
        save(run, step, trained, tiny_model, keep=2)
    (root / "step_7.tmp").mkdir()
    (root / "step_7.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (root / "latest.tmp").write_text("step_7\n")
    third = save(run, 3, trained, tiny_model, keep=2)
    assert not list(root.glob("*.tmp"))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    assert find_latest(run) == third


def test_unknown_fault_phase_is_refused(trained, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "after_lunch@1")
    with pytest.raises(ValueError, match="unknown phase 'after_lunch'; phases: before_dcp"):
        save(tmp_path / "run", 1, trained, tiny_model)


# --- verified checkpoints, pruning, what resume=auto refuses ----------------------------------
def _flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_covers_every_file_and_damage_is_named(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    first = save(run, 1, trained, tiny_model, keep=0)
    second = save(run, 2, trained, tiny_model, keep=0)
    manifest = json.loads((second / ckpt.MANIFEST).read_text())["files"]
    on_disk = {p.name for p in second.iterdir() if p.is_file() and p.name != ckpt.MANIFEST}
    assert set(manifest) == on_disk and not list(second.glob("manifest_rank*"))
    assert all(manifest[n]["size"] == (second / n).stat().st_size for n in on_disk)
    assert ckpt.verify_checkpoint(second)["files"] == len(on_disk)
    policy, optimizer = trained

    shard = next(second.glob("__0_*.distcp"))
    kept = shard.read_bytes()
    _flip_byte(shard)  # same size, different bytes: only the hash can tell
    with pytest.raises(ckpt.CheckpointError) as info:
        load_checkpoint(second, policy.model, optimizer)
    message = str(info.value)
    assert f"checkpoint {second} is damaged: {shard.name} does not match the sha256" in message
    assert f"checkpoint.resume={first}" in message and "It was not loaded" in message
    with pytest.raises(ckpt.CheckpointError, match=shard.name):  # the merge path verifies too
        ckpt.load_full_model_state(second, policy.model)
    shard.write_bytes(kept[:-10])
    with pytest.raises(ckpt.CheckpointError, match=f"{shard.name} is not the {len(kept)} bytes that were written"):
        load_checkpoint(second, policy.model, optimizer)
    shard.write_bytes(kept)
    (second / "rng_rank0.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="rng_rank0.safetensors is missing"):
        load_checkpoint(second, policy.model, optimizer)
    (first / ckpt.MANIFEST).write_text("{torn")
    with pytest.raises(ckpt.CheckpointError, match=r"manifest.json does not parse.*no other complete checkpoint|"
                                                   r"manifest.json does not parse.*step_2"):
        load_checkpoint(first, policy.model, optimizer)


def test_checkpoint_without_manifest_loads_with_a_warning_only_if_written_before_manifests(
        trained, tiny_model, tmp_path, caplog):
    first = save(tmp_path / "run", 1, trained, tiny_model)
    (first / ckpt.MANIFEST).unlink()  # written with a manifest: its loss is damage, not age
    with pytest.raises(ckpt.CheckpointError, match=r"manifest.json is missing, although trainer_state.json says"):
        load_checkpoint(first, trained[0].model, trained[1])
    state = json.loads((first / "trainer_state.json").read_text())
    del state["manifest"]  # as an older vlrl wrote it
    (first / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="vlrl"):
        load_checkpoint(first, trained[0].model, trained[1])
    assert f"checkpoint {first} has no manifest.json" in caplog.text


def test_pruning_never_removes_the_checkpoint_just_written(trained, tiny_model, tmp_path):
    """A run resumed from an older checkpoint of its own folder writes steps below the newest one."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (2, 4):
        save(run, step, trained, tiny_model, keep=2)
    third = save(run, 3, trained, tiny_model, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3", "step_4"]
    assert (root / "latest").read_text().strip() == "step_3" and find_latest(run) == third
    first = save(run, 1, trained, tiny_model, keep=1)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1"]
    assert (root / (root / "latest").read_text().strip()).is_dir() and find_latest(run) == first


def test_resume_auto_stops_when_no_step_folder_is_complete(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    good = save(run, 1, trained, tiny_model)
    (good / ".metadata").unlink()
    (run / "checkpoints" / "step_2.tmp").mkdir()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resolve_resume("auto", run)
    message = str(info.value)
    assert "holds step folders but no complete checkpoint" in message
    assert "step_1 has no .metadata" in message and "step_2.tmp is an interrupted save" in message
    assert "checkpoint.resume=overwrite" in message and "trainer.run_dir" in message
    assert ckpt.resolve_resume("auto", tmp_path / "fresh") is None  # an unused folder starts at step 0


def test_disk_full_inside_a_shard_names_the_file(trained, tiny_model, tmp_path, monkeypatch):
    """The disk fills while torch.save streams a shard: torch itself reports only "enforce fail ...
    unexpected pos"; the error must name the shard and say that no space is left."""
    run = tmp_path / "run"
    first = save(run, 1, trained, tiny_model)
    kept = digest(first)

    class FillingFile(io.FileIO):  # a disk with 64 KiB free: write() fails as the kernel's would
        def write(self, data):
            if self.tell() + memoryview(data).nbytes > 1 << 16:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    @contextmanager
    def filling(self, path, mode):
        with FillingFile(str(path), mode.replace("b", "")) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", filling)
    with pytest.raises(OSError) as info:
        save(run, 2, trained, tiny_model)
    monkeypatch.undo()
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and "unexpected pos" not in message and "enforce fail" not in message
    tmp = run / "checkpoints" / "step_2.tmp"
    assert re.search(rf"{re.escape(str(tmp))} failed: No space left on device writing {re.escape(str(tmp))}/"
                     r"__0_\d+\.distcp; the previous checkpoint \S+step_1 is intact", message), message
    assert find_latest(run) == first and digest(first) == kept and not tmp.exists()


def test_save_removes_only_its_own_temporary_names(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    save(run, 1, trained, tiny_model)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep")
    (root / "my_model.tmp").write_bytes(b"a user's file")
    (root / "scratch.tmp").mkdir()
    (root / "scratch.tmp" / "notes").write_text("a user's folder")
    (root / "step_3.tmp").symlink_to(outside)  # a link named like a save's folder: never deleted through
    for leftover in ("step_7.tmp", "step_1.old.tmp"):  # what interrupted saves leave
        (root / leftover).mkdir()
        (root / leftover / "__0_0.distcp").write_bytes(b"partial")
    (root / "latest.tmp").write_text("step_7\n")
    save(run, 2, trained, tiny_model)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "my_model.tmp", "scratch.tmp", "step_1", "step_2",
                                                      "step_3.tmp"]
    assert (root / "my_model.tmp").read_bytes() == b"a user's file" and (root / "scratch.tmp" / "notes").is_file()
    assert (outside / "data.bin").read_bytes() == b"keep" and (root / "step_3.tmp").is_symlink()


def test_manifest_covers_exactly_the_files_of_the_folder(trained, tiny_model, tmp_path):
    run = tmp_path / "run"
    first = save(run, 1, trained, tiny_model, keep=0)
    second = save(run, 2, trained, tiny_model, keep=0)
    policy, optimizer = trained
    shard = next(second.glob("__0_*.distcp"))

    extra = second / "__0_9.distcp"  # a shard the manifest does not list is never checked: refused
    extra.write_bytes(shard.read_bytes())
    with pytest.raises(ckpt.CheckpointError, match=r"__0_9\.distcp is not listed in manifest\.json"):
        load_checkpoint(second, policy.model, optimizer)
    with pytest.raises(ckpt.CheckpointError, match=r"__0_9\.distcp is not listed"):  # the merge path too
        ckpt.load_full_model_state(second, policy.model)
    extra.unlink()
    (second / "sub").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"sub is not listed"):
        ckpt.verify_checkpoint(second)
    (second / "sub").rmdir()

    state = second / "trainer_state.json"  # a link to an identical copy outside the folder
    copy = tmp_path / "trainer_state.json"
    shutil.copyfile(state, copy)
    state.unlink()
    state.symlink_to(copy)
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state\.json is not a regular file"):
        ckpt.verify_checkpoint(second)
    state.unlink()
    shutil.copyfile(copy, state)

    manifest_path = second / ckpt.MANIFEST
    original = manifest_path.read_text()
    target = first / "trainer_state.json"  # entries that leave the folder, with the right size and hash
    for bad in ("../step_1/trainer_state.json", str(target), "..", "sub/x"):
        manifest = json.loads(original)
        manifest["files"][bad] = ckpt._hash_file(target)
        manifest_path.write_text(json.dumps(manifest))
        with pytest.raises(ckpt.CheckpointError, match=re.escape(f"manifest.json lists {bad!r}, not a file of")):
            ckpt.verify_checkpoint(second)
    manifest_path.write_text(original)
    assert ckpt.verify_checkpoint(second)["files"] == len(json.loads(original)["files"])


def test_metadata_naming_a_shard_outside_the_folder_is_refused(trained, tiny_model, tmp_path):
    step = save(tmp_path / "run", 1, trained, tiny_model)
    shard = next(step.glob("__0_*.distcp"))
    shutil.copyfile(shard, tmp_path / "outside.distcp")  # a readable shard, so only the check can refuse it
    with open(step / ".metadata", "rb") as f:
        metadata = ckpt._MetadataUnpickler(f).load()
    # DCP's own writer rewrites .metadata, with every shard entry pointing outside the folder
    results = [[WriteResult(index=k, size_in_bytes=v.length,
                            storage_data=dataclasses.replace(v, relative_path="../../../outside.distcp"))
                for k, v in metadata.storage_data.items()]]
    FileSystemWriter(step, sync_files=False).finish(metadata, results)
    with pytest.raises(RuntimeError, match=r"names the shard '\.\./\.\./\.\./outside\.distcp', which is not a file of"):
        ckpt.load_dcp({"model": trained[0].model.state_dict()}, step, no_dist=True)


def test_pruning_after_a_recovery_keeps_the_verified_checkpoint(trained, tiny_model, tmp_path):
    """step_4 is damaged, so the run resumes from step_2 and saves step_3 with keep=2: step_2, verified
    at resume, stays; the damaged step_4, which nothing verified, goes."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (2, 4):
        save(run, step, trained, tiny_model, keep=0)
    _flip_byte(next((root / "step_4").glob("__0_*.distcp")))
    ckpt._VERIFIED.clear()  # a new process: it has written and verified nothing yet
    policy, optimizer = trained
    with pytest.raises(ckpt.CheckpointError, match="step_4 is damaged"):  # what resume=auto meets
        load_checkpoint(root / "step_4", policy.model, optimizer)
    load_checkpoint(root / "step_2", policy.model, optimizer)  # checkpoint.resume=.../step_2
    save(run, 3, trained, tiny_model, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_3"]
    assert find_latest(run) == root / "step_3"
