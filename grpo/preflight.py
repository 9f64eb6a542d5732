"""Start-up checks: everything that can be verified before anything heavy loads.

Each failure names the config key to change. Checked: the model folder (config.json, weights,
a supported family), the data files, the engine choice against what this machine has, and the
colocated engine's GPU memory budget.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from grpo.config import Config, ConfigError
from models.family import ADAPTERS
from rollout.factory import resolve_engine_name


def _check_model(path: str) -> None:
    folder = Path(path)
    if not path or not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={path!r}: no config.json there; point it at a Hugging Face model folder on disk")
    if not ((folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()):
        raise ConfigError(f"model.path={path!r}: no model.safetensors or model.safetensors.index.json "
                          "(only safetensors weights are loaded, never pickle files)")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in ADAPTERS:
        raise ConfigError(f"model.path={path!r}: model family '{model_type}' is not supported; "
                          f"supported: {', '.join(sorted(ADAPTERS))}")


def _check_data(cfg: Config) -> None:
    for key, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if key == "data.eval_path" and not path:
            continue
        if not path or not Path(path).is_file():
            raise ConfigError(f"{key}={path!r}: file not found (a parquet or JSONL file on local disk)")


def _check_engine(cfg: Config) -> None:
    if cfg.trainer.mode != "grpo" and not cfg.data.eval_path:
        return
    family = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type")
    try:
        name = resolve_engine_name(cfg.rollout.engine, family)
    except RuntimeError as exc:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: {exc}") from exc
    if name == "vllm" and not 0.0 < cfg.rollout.gpu_memory_utilization < 1.0:
        raise ConfigError("rollout.gpu_memory_utilization must be in (0, 1): the share of GPU memory the "
                          "colocated engine may take while the policy is offloaded")
    if name == "vllm" and torch.cuda.is_available():
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
