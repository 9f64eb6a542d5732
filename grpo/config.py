"""The typed config: one root dataclass, one section per component.

YAML files in `configs/` fill it, `a.b=v` arguments override it, and every key and value is
checked at load: an unknown key names the closest valid one, a wrong type names the key and the
type it wants. `save_config` writes the resolved config into the run folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


@dataclass
class TrainerConfig:
    mode: Literal["grpo", "sft"] = "grpo"
    max_steps: int = 10
    run_dir: str = "runs/default"
    seed: int = 0
    eval_every: int = 0  # 0: evaluate only at the end
    eval_samples: int = 64
    eval_max_new_tokens: int = 32
    progress: bool = True  # progress bar with ETA on stderr (rank 0)
    max_nonfinite_in_row: int = 3  # stop with a checkpoint after this many skipped steps in a row; 0: never


@dataclass
class ModelConfig:
    path: str = ""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 compute on CUDA, fp32 on CPU
    # varlen: FlashAttention's variable-length kernel over packed rows (CUDA; sdpa elsewhere)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "varlen"] = "auto"
    activation_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    task: str = "clevr"
    train_path: str = ""
    eval_path: str = ""
    prompts_per_step: int = 8  # global prompts per step (GRPO) or samples per step (SFT)
    max_prompt_tokens: int = 2048  # prompts longer than this are skipped and counted, never truncated
    min_pixels: int = 28 * 28
    max_pixels: int = 512 * 28 * 28
    shuffle: bool = True


@dataclass
class RolloutConfig:
    engine: Literal["auto", "torch", "vllm"] = "auto"
    n: int = 4  # responses per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1  # ranks per engine (node-local groups of consecutive ranks; rollout/groups.py)
    enforce_eager: bool = False
    refit_bucket_mb: int = 512


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0  # 0 disables; otherwise c > 1 (e.g. 3.0)
    kl_coef: float = 0.0  # 0: no reference model is loaded
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    tis_cap: float = 0.0  # truncated importance sampling cap against engine logprobs; 0 disables
    dynamic_sampling: bool = False
    max_refill_rounds: int = 2
    overlong_buffer: int = 0  # tokens before max_new_tokens where the overlong penalty ramps; 0 disables
    overlong_penalty: float = 1.0
    ppo_epochs: int = 1
    mismatch_mask_threshold: float = 0.0  # mask sequences whose per-seq max exp|dlogp| exceeds this; 0 disables


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    max_tokens_per_microbatch: int = 4096


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end
    resume: str = "auto"  # auto | never | PATH
    keep: int = 2


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    stdout: bool = True


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel degree of the policy's language model
    # HSDP: data-parallel replicas, each sharding the policy over its ranks; 1 = plain FSDP over all
    # data-parallel ranks, 0 = one replica per node (all-gathers stay inside a node)
    replicate: int = 1
    # auto: on GPU, only when the policy with its AdamW state and the engine would not fit together
    offload_during_generate: Literal["auto", "on", "off"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def _closest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; ints widen to float, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
            try:
                return _coerce(key, value, arm)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"config key '{key}': {value!r} fits none of {tp}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(
            f"config key '{key}': expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return value


def _apply(obj: Any, updates: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"unknown config key '{key}'{_closest(name, names)}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
            _apply(current, value, f"{key}.")
        else:
            setattr(obj, name, _coerce(key, value, hints[name]))


def parse_override(text: str) -> dict:
    """`a.b=v` → {'a': {'b': v}} with v parsed as a YAML scalar (so 3 is int, 1e-6 float, true bool)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.sub=value")
    dotted, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    for part in reversed(dotted.strip().split(".")):
        value = {part: value}
    return value


def _float_literal(value: Any) -> Any:
    # YAML 1.1 reads "1e-6" as a string; accept it as the float everyone means.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            return value
    return value


def _normalize_floats(obj: Any, updates: dict) -> dict:
    hints = typing.get_type_hints(type(obj))
    out = {}
    for name, value in updates.items():
        if name in hints and dataclasses.is_dataclass(getattr(obj, name, None)) and isinstance(value, dict):
            out[name] = _normalize_floats(getattr(obj, name), value)
        elif hints.get(name) is float:
            out[name] = _float_literal(value)
        else:
            out[name] = value
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Build the root config from an optional YAML file and `a.b=v` overrides, validating every key."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        _apply(cfg, _normalize_floats(cfg, data), "")
    for text in overrides or []:
        _apply(cfg, _normalize_floats(cfg, parse_override(text)), "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that a single type annotation cannot express."""
    if cfg.trainer.max_steps < 0:
        raise ConfigError("config key 'trainer.max_steps' must be >= 0")
    if cfg.rollout.n < 1:
        raise ConfigError("config key 'rollout.n' must be >= 1")
    if cfg.algorithm.dual_clip and cfg.algorithm.dual_clip <= 1.0:
        raise ConfigError("config key 'algorithm.dual_clip' must be 0 (off) or > 1")
    if not (cfg.optim.lr > 0 and cfg.optim.lr < float("inf")):
        raise ConfigError(f"config key 'optim.lr' must be a finite positive number, got {cfg.optim.lr}")
    if cfg.optim.max_tokens_per_microbatch < 1:
        raise ConfigError("config key 'optim.max_tokens_per_microbatch' must be >= 1")
    if cfg.checkpoint.resume not in ("auto", "never") and not cfg.checkpoint.resume:
        raise ConfigError("config key 'checkpoint.resume' must be auto, never or a checkpoint path")


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
