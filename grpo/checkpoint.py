"""Resume checkpoints with torch.distributed.checkpoint (every rank writes its own shards).

Layout: `<run_dir>/checkpoints/step_<N>/` holds the DCP shards of model and optimizer, one
`rng_rank<R>.safetensors` per rank, `trainer_state.json` (step, data position, counters) and a
copy of the model folder's config/processor/tokenizer files so `tools/checkpoint_merge.py` needs
nothing else. A checkpoint is written under `step_<N>.tmp`, renamed when complete, and only then
named by the `latest` pointer: a crash mid-write never leaves a checkpoint that looks complete
(files and folders are fsynced before each rename; see `save_checkpoint`). `find_latest` only
returns complete folders, and the next save removes leftovers of an interrupted one: only the
temporary names a save itself uses (`step_<N>.tmp`, `step_<N>.old.tmp`, `latest.tmp`), never other
`*.tmp` files. Pruning keeps the checkpoint just written whatever its step, so `latest` never names
a removed folder, and never keeps a checkpoint this process has not verified (or written) in place
of one it has. A write error names the file and its cause ("No space left on device"), however
deep in DCP or torch.save it happened.

Every checkpoint carries `manifest.json`: the size and sha256 of each file in it, recorded at save
(each rank hashes the shards it wrote, streaming, while they are still in the page cache; rank 0
adds `.metadata`, trainer state and side files). `load_checkpoint` and `load_full_model_state`
verify a checkpoint before reading it: sizes first, then hashes, the files split across ranks.
The manifest covers exactly the files of the folder: a file it does not list, a listed file
that is missing or is not a regular file (a symbolic link, a folder), and an entry that is not a
plain file name (absolute, `..`, a subfolder) are errors. sha256 runs at about 1.2 GB/s per core,
so a save or resume costs one read of each rank's own share (a 7B model with AdamW state over 8
ranks: about 10 GB and 9 s per rank). A damaged or
incomplete checkpoint raises CheckpointError naming the folder, the file and what to do.

Loading never runs pickled code: DCP keeps its `.metadata` as a pickle and reads non-tensor items
with `torch.load(weights_only=False)`, so `load_dcp` swaps in a reader whose unpickler accepts only
DCP's own metadata classes and a planner that decodes those items weights-only first. RNG state is
safetensors, trainer state is JSON.

Test hook: the environment variable `VLRL_FAULT_AT=PHASE[@STEP]` kills the process at one phase of
a save (see `_fault_point`); only `save_checkpoint` reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import io
import json
import logging
import os
import pickle  # only the allowlisted _MetadataUnpickler below; see its docstring
import re
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from safetensors.torch import save as tensors_to_bytes
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from models.lora import lora_description
from models.policy import _SIDE_FILES

log = logging.getLogger("vlrl")
MANIFEST = "manifest.json"
_RANK_MANIFEST = "manifest_rank{rank}.json"
LORA_FILE = "lora.json"  # rank, alpha and adapted layers of a LoRA policy: what the merge tool rebuilds
_HASH_CHUNK = 8 << 20
_VERIFIED: set[Path] = set()  # checkpoint folders (resolved) this process wrote or verified in full; see _prune


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted (damaged, incomplete) or no usable one where one is needed."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


FAULT_ENV = "VLRL_FAULT_AT"
FAULT_PHASES = ("before_dcp", "after_dcp", "after_state", "after_rename")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OWN_TEMPORARY = re.compile(r"^step_\d+(\.old)?\.tmp$")  # the folders a save writes or sets aside
_LATEST_TMP = "latest.tmp"


def _fault_point(phase: str, step: int) -> None:
    """Test hook: `VLRL_FAULT_AT=PHASE[@STEP]` kills this process with SIGKILL at that write phase.

    Phases, in order: before_dcp (temporary folder made, no shards yet; every rank), after_dcp
    (shards and RNG written, before trainer_state.json; rank 0), after_state (before the rename;
    rank 0), after_rename (renamed, before the `latest` pointer; rank 0). The fault-injection
    tests use it to check that a crash at any point leaves the last complete checkpoint usable.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name not in FAULT_PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown phase {name!r}; phases: {', '.join(FAULT_PHASES)}")
    if name == phase and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the data files are synced
    finally:
        os.close(fd)


def _os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError with an errno in `exc` or its causes: torch.save reports a failed write
    (a full disk) as "enforce fail ... unexpected pos" with the OSError only as its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _named(exc: OSError, path: Path) -> OSError:
    """`exc` with the file it concerns (a failed write() does not say which file it was writing)."""
    if exc.filename is not None or exc.errno is None:
        return exc
    named = OSError(exc.errno, exc.strerror, str(path))
    named.__cause__ = exc
    return named


class _NamingFileSystem(FileSystem):
    """DCP's file system, with any failure while writing a file raised as the OSError behind it,
    naming the file, instead of torch.save's "enforce fail ... unexpected pos"."""

    @contextmanager
    def create_stream(self, path, mode):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged unless an OSError is behind it
            cause = _os_error_in(exc)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from exc


def _dcp_writer(folder: Path) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(str(folder))
    writer.fs = _NamingFileSystem()
    return writer


def _write_durable(path: Path, text: str | bytes) -> None:
    try:
        with open(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _named(exc, path) from exc


def _copy_durable(src: Path, dst: Path) -> None:
    try:
        shutil.copyfile(src, dst)
        _fsync_file(dst)
    except OSError as exc:
        raise _named(exc, dst) from exc


def _remove_stale(root: Path) -> None:
    """Drop leftovers of interrupted saves: only the temporary names a save itself uses (real
    folders `step_<N>.tmp` and `step_<N>.old.tmp`, the file `latest.tmp`), never a link or another name."""
    for leftover in root.iterdir():
        if _OWN_TEMPORARY.match(leftover.name) and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.name == _LATEST_TMP and leftover.is_file() and not leftover.is_symlink():
            leftover.unlink(missing_ok=True)


def _agree(ok: bool) -> bool:
    """True when every rank succeeded; replaces a barrier so a failed rank cannot hang the others."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def save_checkpoint(run_dir, step: int, model, optimizer, trainer_state: dict, model_path: str, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step`; collective over all ranks.

    Order (each step durable before the next): shards + RNG + trainer_state.json in
    `step_N.tmp`, fsync, rename to `step_N`, fsync the folder, then the `latest` pointer by an
    atomic replace. A crash at any point leaves the previous complete checkpoint and pointer as
    they were. A write error (disk full, ...) raises OSError naming the folder on every rank,
    after removing the partial folder; the previous checkpoint stays `latest`.
    """
    root = Path(run_dir) / "checkpoints"
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp.mkdir()
        except OSError as exc:
            error = exc
    if _agree(error is None):
        _fault_point("before_dcp", step)
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_dcp_writer(tmp))
            _write_durable(tmp / f"rng_rank{rank}.safetensors", tensors_to_bytes(_rng_state()))
            _write_rank_manifest(tmp, rank)
        except (Exception, dcp.CheckpointException) as exc:  # DCP's own type, raised on every rank
            error = exc
    if _agree(error is None) and rank == 0:
        try:
            _finish(root, tmp, final, step, trainer_state, model_path, keep, lora_description(model))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would hang
            error = exc
    if not _agree(error is None):
        _fail(root, tmp, error)
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, trainer_state: dict, model_path: str, keep: int,
            lora: dict | None = None) -> None:
    """Rank 0: trainer state, LoRA description and side files, then make the checkpoint visible (rename, pointer)."""
    _fault_point("after_dcp", step)
    # "manifest" records that this checkpoint has one: deleting manifest.json cannot pass it off as
    # a checkpoint from before manifests, which loads unverified with a warning
    _write_durable(tmp / "trainer_state.json", json.dumps({**trainer_state, "step": step, "manifest": MANIFEST},
                                                          indent=1))
    if lora is not None:
        _write_durable(tmp / LORA_FILE, json.dumps(lora, indent=1))
    for name in ("config.json", *_SIDE_FILES):
        src = Path(model_path) / name
        if src.is_file():
            _copy_durable(src, tmp / name)
    _write_manifest(tmp)
    _fsync_dir(tmp)
    _fault_point("after_state", step)
    if final.exists():  # a re-run of this step (resumed from an older checkpoint): set the old copy aside
        os.replace(final, final.with_name(final.name + ".old.tmp"))
    os.replace(tmp, final)
    _fsync_dir(root)
    _fault_point("after_rename", step)
    _VERIFIED.add(final.resolve())
    _write_latest(root, final.name)
    shutil.rmtree(final.with_name(final.name + ".old.tmp"), ignore_errors=True)
    _prune(root, keep, final)


def _fail(root: Path, tmp: Path, error: BaseException | None) -> None:
    """Every rank raises; rank 0 removes the partial folder (on a full disk that frees the space)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = find_latest(root.parent)
    kept = f"the previous checkpoint {latest} is intact and still `latest`" if latest else "no earlier checkpoint exists"
    if error is None:
        raise OSError(f"writing checkpoint {tmp} failed on another rank (see its log); {kept}")
    cause = _root_error(error)
    os_error = _os_error_in(cause)
    if os_error is not None:
        where = f" writing {os_error.filename}" if os_error.filename else ""
        advice = "Free disk space or point trainer.run_dir elsewhere, then resume with checkpoint.resume=auto"
        raise OSError(os_error.errno, f"writing checkpoint {tmp} failed: {os_error.strerror or os_error}{where}; "
                                      f"{kept}. {advice}") from error
    raise RuntimeError(f"writing checkpoint {tmp} failed ({type(cause).__name__}: {cause}); {kept}") from error


def _root_error(error: BaseException) -> BaseException:
    """The first rank's underlying exception inside DCP's CheckpointException (else `error` itself)."""
    failures = getattr(error, "failures", None)
    if isinstance(error, dcp.CheckpointException) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


def _hash_file(path: Path) -> dict:
    """Size and sha256 of one file, read in chunks (bounded memory whatever the shard size)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _write_rank_manifest(folder: Path, rank: int) -> None:
    """This rank's shards (DCP names them `__<rank>_<n>.distcp`) and RNG file, hashed where they were written."""
    files = [*sorted(folder.glob(f"__{rank}_*.distcp")), folder / f"rng_rank{rank}.safetensors"]
    entries = {p.name: _hash_file(p) for p in files if p.is_file()}
    _write_durable(folder / _RANK_MANIFEST.format(rank=rank), json.dumps(entries))


def _write_manifest(folder: Path) -> None:
    """Rank 0: merge the ranks' manifests and hash every file they do not cover into `manifest.json`."""
    entries: dict[str, dict] = {}
    rank_files = sorted(folder.glob(_RANK_MANIFEST.format(rank="*")))
    for part in rank_files:
        entries.update(json.loads(part.read_text()))
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in entries and path not in rank_files:
            entries[path.name] = _hash_file(path)
    _write_durable(folder / MANIFEST, json.dumps({"algorithm": "sha256", "files": entries}, indent=0))
    for part in rank_files:
        part.unlink()


_MISSING, _NOT_REGULAR, _RESIZED, _CHANGED = 1, 2, 3, 4


def _check_file(folder: Path, name: str, entry: dict, check_hash: bool) -> int:
    """0 when the file matches its manifest entry, else _MISSING / _NOT_REGULAR / _RESIZED / _CHANGED."""
    path = folder / name
    if not os.path.lexists(path):
        return _MISSING
    if path.is_symlink() or not path.is_file():
        return _NOT_REGULAR
    if path.stat().st_size != entry["size"]:
        return _RESIZED
    if check_hash and _hash_file(path)["sha256"] != entry["sha256"]:
        return _CHANGED
    return 0


def _describe(name: str, code: int, entry: dict) -> str:
    if code == _MISSING:
        return f"{name} is missing"
    if code == _NOT_REGULAR:
        return f"{name} is not a regular file (a symbolic link or a folder; a checkpoint holds only its own files)"
    if code == _RESIZED:
        return f"{name} is not the {entry['size']} bytes that were written"
    return f"{name} does not match the sha256 recorded when it was written (its bytes changed)"


def _is_plain_name(name: str) -> bool:
    """A file name directly inside the folder: not absolute, not `.`/`..`, no separator."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _read_manifest(folder: Path) -> dict | None:
    """The manifest's entries by file name, or None without a manifest; CheckpointError when it does
    not parse, is a link, or names anything but a plain file name inside the folder."""
    path = folder / MANIFEST
    if path.is_symlink():
        raise CheckpointError(f"checkpoint {folder} is damaged: {MANIFEST} is a symbolic link; {_advice(folder)}")
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        entries = {str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])} for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {folder} is damaged: {MANIFEST} does not parse ({exc}); "
                              f"{_advice(folder)}") from exc
    outside = [name for name in entries if not _is_plain_name(name) or name == MANIFEST]
    if outside:
        raise CheckpointError(f"checkpoint {folder} is damaged: {MANIFEST} lists {', '.join(map(repr, outside))}, "
                              "not a file of the checkpoint folder (only plain file names inside it are allowed; "
                              f"nothing was read); {_advice(folder)}")
    return entries


def _written_with_manifest(folder: Path) -> bool:
    try:
        return json.loads((folder / "trainer_state.json").read_text()).get("manifest") == MANIFEST
    except (OSError, ValueError, AttributeError):
        return False


def _unlisted(folder: Path, manifest: dict) -> list[str]:
    """Entries of the checkpoint folder that its manifest does not list (files, folders, links)."""
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in manifest)


def _advice(folder: Path) -> str:
    """What to do about a damaged checkpoint: the other complete ones of its run, or starting over."""
    others = sorted((p for p in folder.parent.glob("step_*") if p != folder and is_complete(p)), key=_step_of)
    if others:
        return (f"resume from an earlier checkpoint with checkpoint.resume={others[-1]} (complete ones: "
                f"{', '.join(p.name for p in others)}), or start over with checkpoint.resume=overwrite")
    return "no other complete checkpoint exists in this run; start over with checkpoint.resume=overwrite"


def verify_checkpoint(folder: str | Path) -> dict:
    """Check every file of a checkpoint against its manifest; raise CheckpointError naming what is wrong.

    The manifest must cover exactly the folder's entries: one it does not list, a listed file that
    is missing or not a regular file, and an entry that leaves the folder are errors.
    Collective when a process group is up: every rank checks all sizes and hashes its share of the
    files (round robin), and all ranks learn the result, so all raise the same message. Without a
    group (the merge tool) one process checks everything. Returns {files, bytes, seconds}.
    A checkpoint written before manifests existed is loaded with a warning that names it; one
    whose trainer_state.json says it was written with a manifest, but has none, is an error.
    A checkpoint that passes is remembered as verified for pruning (`_prune`).
    """
    folder = Path(folder)
    t0 = time.monotonic()
    manifest = _read_manifest(folder)
    if manifest is None:
        if _written_with_manifest(folder):
            raise CheckpointError(f"checkpoint {folder} is damaged: {MANIFEST} is missing, although trainer_state.json "
                                  "says the checkpoint was written with one, so its files cannot be verified. It was "
                                  f"not loaded; {_advice(folder)}")
        log.warning("checkpoint %s has no %s (written by an older vlrl): its files cannot be verified", folder, MANIFEST)
        return {"files": 0, "bytes": 0, "seconds": 0.0}
    names = sorted(manifest)
    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    unlisted = _unlisted(folder, manifest)
    codes = torch.tensor([_check_file(folder, n, manifest[n], check_hash=i % world == rank)
                          for i, n in enumerate(names)] + [int(bool(unlisted))], dtype=torch.int32)
    if grouped and world > 1:
        if dist.get_backend() == "nccl":
            codes = codes.cuda()
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    *codes, any_unlisted = codes.tolist()
    damaged = [_describe(n, c, manifest[n]) for n, c in zip(names, codes) if c]
    if any_unlisted:
        damaged.append(f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not listed in {MANIFEST}, so "
                       "cannot be verified (move it out of the folder if it is not part of the checkpoint)"
                       if unlisted else f"another rank sees entries not listed in {MANIFEST}")
    if damaged:
        raise CheckpointError(f"checkpoint {folder} is damaged: {'; '.join(damaged)}. It was not loaded; "
                              f"{_advice(folder)}")
    _VERIFIED.add(folder.resolve())
    return {"files": len(names), "bytes": sum(e["size"] for e in manifest.values()), "seconds": time.monotonic() - t0}


def _write_latest(root: Path, name: str) -> None:
    tmp = root / "latest.tmp"
    _write_durable(tmp, name + "\n")
    os.replace(tmp, root / "latest")
    _fsync_dir(root)


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def _prune(root: Path, keep: int, written: Path) -> None:
    """Keep `written` (the checkpoint just saved, whatever its step) and `keep - 1` other complete
    checkpoints; the rest go, as do incomplete step folders older than every kept one.

    `written` is what `latest` names, so the pointer never names a removed folder, even when
    higher steps exist (a run resumed from an older checkpoint of its own folder). The others kept
    are the newest this process verified (the one it resumed from) or wrote, and only then the
    newest unverified ones: after a resume that went around a damaged checkpoint, the damaged one
    is never kept in place of the good one.
    """
    if keep <= 0:
        return
    others = sorted((p for p in root.iterdir() if p != written and is_complete(p)),
                    key=lambda p: (p.resolve() in _VERIFIED, _step_of(p)))
    kept = [written, *others[len(others) - (keep - 1):]] if keep > 1 else [written]
    oldest_kept = min(_step_of(p) for p in kept)
    for old in root.iterdir():
        step = _step_of(old)
        if old in kept or step is None or not old.is_dir():
            continue
        if is_complete(old) or step < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)


def is_complete(path: Path) -> bool:
    """A finished checkpoint folder: named step_N (not *.tmp), with DCP metadata and trainer state."""
    return path.is_dir() and _step_of(path) is not None and (path / "trainer_state.json").is_file() and (
        path / ".metadata"
    ).is_file()


def _incomplete_reason(path: Path) -> str:
    if path.name.endswith(".tmp"):
        return f"{path.name} is an interrupted save"
    missing = [n for n in (".metadata", "trainer_state.json") if not (path / n).is_file()]
    return f"{path.name} has no {' and no '.join(missing)}"


def scan_checkpoints(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume=auto` loads, and a note naming each step folder or pointer it passes over.

    The checkpoint is the one `latest` names when that is complete, else the highest complete step.
    `*.tmp` folders (interrupted saves) and folders missing `.metadata` or `trainer_state.json` are
    never returned. The pointer's content is only ever a folder name inside `checkpoints/`.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None, []
    folders = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name)
    done = [p for p in folders if is_complete(p)]
    notes = [_incomplete_reason(p) for p in folders if not is_complete(p)]
    newest = max(done, key=_step_of) if done else None
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        if _STEP_DIR.match(name) and is_complete(root / name):
            return root / name, notes
        fallback = f"the newest complete one, {newest.name}" if newest else "none is complete"
        notes.append(f"`latest` names {name!r}, which is not a complete checkpoint ({fallback})")
    return newest, notes


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run folder (see `scan_checkpoints`), or None."""
    return scan_checkpoints(run_dir)[0]


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint to load for `checkpoint.resume`: auto | never | overwrite | PATH.

    `auto` with step folders but none complete raises CheckpointError saying what to do, rather
    than starting from step 0 over what is there. Folders and pointers passed over are logged.
    """
    if resume in ("never", "overwrite"):
        return None
    if resume == "auto":
        latest, notes = scan_checkpoints(run_dir)
        if latest is None and notes:
            root = Path(run_dir) / "checkpoints"
            raise CheckpointError(
                f"checkpoint.resume=auto: {root} holds step folders but no complete checkpoint "
                f"({'; '.join(notes)}). Nothing was loaded or changed. To start over in this folder (deleting its "
                "checkpoints, metrics.jsonl and TensorBoard logs) set checkpoint.resume=overwrite; to keep them, "
                "set trainer.run_dir to a new folder"
            )
        for note in notes:
            log.warning("resume: passing over %s: %s", Path(run_dir) / "checkpoints", note)
        return latest
    path = Path(resume)
    if not is_complete(path):
        raise FileNotFoundError(f"checkpoint.resume={resume}: not a complete checkpoint folder"
                                + (f" ({_incomplete_reason(path)})" if path.is_dir() else ""))
    return path


_DCP_DATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PLAIN_GLOBALS = {
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex", "range", "bytearray"},
    "torch.serialization": {"_get_layout"},
}


def _allowed_global(module: str, name: str) -> bool:
    """Whether DCP metadata may name `module.name`: its own dataclasses/enums, torch dtypes, sizes, paths."""
    if module in _DCP_DATA_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    return name in _PLAIN_GLOBALS.get(module, ())


class _MetadataUnpickler(pickle.Unpickler):
    """DCP stores `.metadata` as a pickle; this reads it while refusing every global outside the allowlist,
    so a crafted checkpoint folder cannot run code when resumed from or merged."""

    def find_class(self, module: str, name: str):
        if not _allowed_global(module, name):
            raise pickle.UnpicklingError(
                f"checkpoint metadata names {module}.{name}, which a DCP checkpoint never contains; refusing to load it"
            )
        return super().find_class(module, name)


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata goes through `_MetadataUnpickler` instead of plain `pickle.load`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self.path) / ".metadata"
        if not path.is_file():
            raise FileNotFoundError(f"{path.parent} is not a DCP checkpoint: no .metadata file")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if not _is_plain_name(name):
                raise CheckpointError(f"{path} names the shard {name!r}, which is not a file of {path.parent}; "
                                      "refusing to read it")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _WeightsOnlyPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner that accepts non-tensor items (optimizer hyper-parameters) only as plain data.

    DCP reads them with `torch.load(weights_only=False)`; each is first decoded with
    `weights_only=True`, which refuses anything but tensors and plain Python values, so the full
    load that follows can only rebuild plain data.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def load_dcp(state: dict, path: str | Path, *, no_dist: bool = False) -> None:
    """`dcp.load` into `state` in place, with the pickle-free reader and planner above.

    DCP reports failures as CheckpointException, which is not an Exception subclass; it is
    re-raised as a RuntimeError naming the folder and the first rank's cause.
    """
    kwargs = {"no_dist": True} if no_dist else {}
    try:
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_WeightsOnlyPlanner(), **kwargs)
    except dcp.CheckpointException as exc:
        cause = _root_error(exc)
        raise RuntimeError(f"loading checkpoint {path} failed: {type(cause).__name__}: {cause}") from exc


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Verify the checkpoint (collective), then restore model, optimizer and this rank's RNG; returns
    the trainer state dict."""
    checked = verify_checkpoint(path)
    _check_lora_matches(path, lora_description(model))
    if checked["files"] and dist.get_rank() == 0:
        log.info("verified %s: %d files, %.1f MB, %.2f s", path, checked["files"], checked["bytes"] / 1e6,
                 checked["seconds"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_dcp(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng_rank{dist.get_rank()}.safetensors"
    if rng.is_file():
        _set_rng_state(load_file(str(rng)))
    return json.loads((path / "trainer_state.json").read_text())


def read_lora(path: str | Path) -> dict | None:
    """The checkpoint's LoRA description (rank, alpha, adapted layer names), or None without adapters."""
    file = Path(path) / LORA_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def _check_lora_matches(path: Path, mine: dict | None) -> None:
    """Refuse to resume adapters into a model without the same ones (DCP would load the frozen base
    weights and silently leave the adapters behind, or start them from scratch)."""
    theirs = read_lora(path)
    if theirs == mine:
        return
    def words(d):
        return "no LoRA" if d is None else f"LoRA rank {d['rank']}, alpha {d['alpha']} on {len(d['modules'])} layers"
    raise CheckpointError(f"checkpoint {path} holds {words(theirs)} but this run's policy has {words(mine)}; set "
                          "model.lora to match the checkpoint, or start over with checkpoint.resume=overwrite")


def load_full_model_state(path: str | Path, model) -> None:
    """Fill an unsharded model (single process, no process group) from a checkpoint's model shards,
    after verifying every file of the checkpoint against its manifest."""
    verify_checkpoint(path)
    state = {"model": model.state_dict()}
    load_dcp(state, path, no_dist=True)
    model.load_state_dict(state["model"], strict=False)


__all__ = ["save_checkpoint", "load_checkpoint", "load_dcp", "read_lora", "LORA_FILE", "find_latest", "scan_checkpoints", "resolve_resume",
           "load_full_model_state", "verify_checkpoint", "is_complete", "CheckpointError", "MANIFEST", "FAULT_ENV",
           "FAULT_PHASES", "StateDictOptions"]
