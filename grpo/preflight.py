"""Start-up checks: everything that can be verified before anything heavy loads.

Each failure names the config key to change. Checked: the model folder (config.json parses, a
supported family, tokenizer files, each safetensors file's header against its size), the train
and eval files (they open, and some of `SAMPLE_ROWS` rows spread over each decode), the engine
choice against what this machine has, and the colocated engine's GPU memory budget.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from data.datasets import SkipStats, VLDataset, video_kwargs
from data.images import BadSample
from grpo.config import Config, ConfigError
from models.family import ADAPTERS, FAMILIES
from models.policy import check_config_dtypes
from rollout.factory import resolve_engine_name


SAMPLE_ROWS = 8  # rows of each data file decoded at start
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _read_json(path: Path, key: str, value: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting
        raise ConfigError(f"{key}={value!r}: {path.name} is not valid JSON ({exc}); restore it from the source "
                          "checkpoint") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{key}={value!r}: {path.name} holds a {type(data).__name__}, not a JSON object")
    return data


def _check_safetensors(path: Path, value: str) -> None:
    """The header parses and the tensors it describes fit in the file (a truncated copy fails here)."""
    where = f"model.path={value!r}: {path.name}"
    if not path.is_file():
        raise ConfigError(f"{where} is missing (named by model.safetensors.index.json); copy the whole checkpoint")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise ConfigError(f"{where} is not a safetensors file ({size} bytes; its header length reads {n}); "
                                  "re-copy or re-export the checkpoint")
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: the safetensors header does not parse ({exc}); re-copy or re-export the "
                          "checkpoint") from exc
    if 8 + n + end > size:
        raise ConfigError(f"{where} is truncated: its header describes {8 + n + end} bytes, the file has {size}; "
                          "re-copy the checkpoint")


def _weight_files(folder: Path, value: str) -> list[Path]:
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "model.path", value).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"model.path={value!r}: {index.name} has no weight_map; restore it from the source")
        return [folder / name for name in sorted(set(map(str, weight_map.values())))]
    raise ConfigError(f"model.path={value!r}: no model.safetensors or model.safetensors.index.json "
                      "(only safetensors weights are loaded, never pickle files)")


def _check_model(path: str) -> None:
    folder = Path(path)
    if not path or not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={path!r}: no config.json there; point it at a Hugging Face model folder on disk")
    model_config = _read_json(folder / "config.json", "model.path", path)
    try:
        check_config_dtypes(model_config, f"model.path={path!r}: config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model_type = model_config.get("model_type")
    weights = _weight_files(folder, path)
    if model_type not in ADAPTERS:
        raise ConfigError(f"model.path={path!r}: model family '{model_type}' is not supported; "
                          f"supported: {', '.join(sorted(ADAPTERS))}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.path={path!r}: no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the tokenizer "
                          "files of the source checkpoint into the folder")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            _read_json(folder / name, "model.path", path)
    for file in weights:
        _check_safetensors(file, path)


def _sample_rows(key: str, path: str, cfg: Config) -> None:
    """Open a data file and decode up to SAMPLE_ROWS rows spread over it; at least one must be usable."""
    d = cfg.data
    try:
        # each image takes at least one prompt token: a row listing more is refused before decoding
        dataset = VLDataset(path, d.task, min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                            max_images=d.max_prompt_tokens, **video_kwargs(d))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors for a file that is not what its name says
        raise ConfigError(f"{key}={path!r}: cannot read it ({type(exc).__name__}: {exc})") from exc
    rows = len(dataset)
    if rows == 0:
        raise ConfigError(f"{key}={path!r}: the file has no rows")
    n = min(SAMPLE_ROWS, rows)
    stats, usable, first = SkipStats(), 0, None
    for index in (i * rows // n for i in range(n)):
        try:
            dataset.get(index)
            usable += 1
        except BadSample as bad:
            stats.record(index, bad.reason, dataset.path, bad.detail)
            first = first or f"row {index}: {bad}"
    if usable:
        return
    reasons = ", ".join(f"{r}: {c}" for r, c in stats.as_dict().items())
    raise ConfigError(f"{key}={path!r}: none of {n} rows sampled across its {rows} rows is usable ({reasons}; "
                      f"{first}; each row is logged above). Check data.task={d.task}, the file's columns and "
                      "images; `python -m data.datasets inspect FILE --task T` scans it all")


def _check_data(cfg: Config) -> None:
    for key, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if key == "data.eval_path" and not path:
            continue
        if not path or not Path(path).is_file():
            raise ConfigError(f"{key}={path!r}: file not found (a parquet or JSONL file on local disk)")
        _sample_rows(key, path, cfg)
        _check_video_family(key, path, cfg)


def _check_video_family(key: str, path: str, cfg: Config) -> None:
    """A dataset with videos needs a family that takes video (its image rule has a video placeholder)."""
    from data.processing import videos_per_row

    if not videos_per_row(path):
        return
    family = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type")
    takes = sorted(name for name, spec in FAMILIES.items()
                   if any(getattr(rule, "video_placeholder", None) for rule in spec.image_rules.values()))
    if family not in takes:
        raise ConfigError(f"{key}={path!r}: rows have `videos`, but model family '{family}' takes no video "
                          f"(families that do: {', '.join(takes)}); use one of them or a dataset without videos")


def _check_engine(cfg: Config) -> None:
    if cfg.trainer.mode != "grpo" and not cfg.data.eval_path:
        return
    family = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type")
    if cfg.rollout.tools and FAMILIES[family].tool_format is None:
        with_tools = sorted(k for k, spec in FAMILIES.items() if spec.tool_format is not None)
        raise ConfigError(f"rollout.tools={list(cfg.rollout.tools)}: model family '{family}' has no tool-call format "
                          f"(families with one: {', '.join(with_tools)}); set rollout.tools=[]")
    try:
        name = resolve_engine_name(cfg.rollout.engine, family)
    except RuntimeError as exc:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: {exc}") from exc
    if name == "vllm" and not 0.0 <= cfg.rollout.gpu_memory_utilization < 1.0:
        raise ConfigError("rollout.gpu_memory_utilization must be in [0, 1): the share of GPU memory the "
                          "colocated engine may take while awake (0: the memory plan decides)")
    if name == "vllm" and torch.cuda.is_available() and cfg.rollout.gpu_memory_utilization > 0:
        free, total = torch.cuda.mem_get_info()
        want = cfg.rollout.gpu_memory_utilization * total
        if want > free:
            raise ConfigError(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} asks for "
                              f"{want / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB is free on this GPU; lower it")


def _check_batch(cfg: Config, world_size: int) -> None:
    if world_size % cfg.parallel.tp:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp} does not divide the world size {world_size}")
    dp = world_size // cfg.parallel.tp
    if cfg.data.prompts_per_step % dp:
        raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} does not divide across {dp} "
                          f"data-parallel ranks; use a multiple of {dp}")
    from models.parallel import resolve_replicate
    from rollout.groups import check_layout

    if cfg.trainer.mode == "grpo":
        try:
            check_layout(cfg.rollout.tensor_parallel_size, world_size,
                         int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        except ValueError as err:
            raise ConfigError(str(err)) from None

    if cfg.parallel.replicate < 0:
        raise ConfigError(f"parallel.replicate={cfg.parallel.replicate} must be 0 (one replica per node) or positive")
    replicate = resolve_replicate(cfg.parallel.replicate, world_size)
    if dp % replicate:
        raise ConfigError(f"parallel.replicate={cfg.parallel.replicate} (→ {replicate} replicas) does not divide the "
                          f"{dp} data-parallel ranks")


def preflight(cfg: Config, world_size: int = 1) -> None:
    """Raise ConfigError naming the key to change; run before distributed models are built."""
    _check_batch(cfg, world_size)
    _check_model(cfg.model.path)
    _check_data(cfg)
    _check_engine(cfg)
