"""LoRA adapters on a VLM's linear layers: apply before sharding, merge for the engine and for export.

`apply_lora` swaps each targeted `nn.Linear` for a `LoraLinear` that keeps the original weight
and bias under their own names (`...q_proj.weight`, `...q_proj.bias`: the checkpoint loads as
before) and adds `lora_A` (rank × in) and `lora_B` (out × rank):

    y = x Wᵀ + b + (alpha / rank) · (x Aᵀ) Bᵀ

It runs on the meta-device model, before `apply_parallelism`, so FSDP2 shards the adapters inside
the same units as their base weights (each decoder block, the vision tower). Every parameter of
the model is frozen except the adapters. After the weights are loaded, `init_lora_weights` draws
A like `nn.Linear`'s default (Kaiming-uniform, a = sqrt(5)) from a fixed seed, the same full
tensor on every rank whatever the world size, and sets B to zero, so the initial policy is the
base model exactly.

The engine and exported folders never see adapter names: `merged_weight` folds B·A into W (in
fp32) and `merge_lora` turns every `LoraLinear` back into an `nn.Linear` holding the merged weight.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.parallel import full_value

# Linear layers of a decoder block across the supported families (GLM-4V fuses gate and up).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
INIT_SEED = 0  # adapters start from one fixed draw: a run is reproducible whatever trainer.seed says


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **like))
        self.adapters_on = True  # False inside `adapters_off`: the base layer alone (the reference model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def _matching(root: nn.Module, suffixes, names: dict[int, str]) -> dict[str, list[str]]:
    """suffix → qualified names (from the model's root) of the nn.Linear modules under `root` it names."""
    found: dict[str, list[str]] = {s: [] for s in suffixes}
    for local, module in root.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for s in suffixes:
            if local == s or local.endswith("." + s):
                found[s].append(names[id(module)])
    return found


def lora_module_names(model: nn.Module, adapter, targets, vision_targets=()) -> list[str]:
    """Qualified names of the linear layers `model.lora.targets` (in the decoder blocks) and
    `model.lora.vision_targets` (in the vision tower) select.

    A target that names no linear layer is an error, except in the default target list, which
    covers several families' names at once and keeps the ones this model has.
    """
    names = {id(m): n for n, m in model.named_modules()}
    chosen: list[str] = []
    strict = tuple(targets) != DEFAULT_TARGETS
    layers = nn.ModuleList(adapter.decoder_layers(model))
    for where, root, suffixes, must in (("model.lora.targets", layers, targets, strict),
                                        ("model.lora.vision_targets", adapter.vision_tower(model), vision_targets, True)):
        found = _matching(root, suffixes, names)
        missing = [s for s, hits in found.items() if not hits]
        if missing and (must or len(missing) == len(found)):
            have = sorted({n.rsplit(".", 1)[-1] for n, m in root.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"{where}: {missing} name no linear layer of this model's "
                             f"{'decoder blocks' if root is layers else 'vision tower'}; its linear layers end in "
                             f"{', '.join(have)}")
        chosen += [n for hits in found.values() for n in hits]
    return sorted(set(chosen))


def apply_lora(model: nn.Module, module_names, rank: int, alpha: float) -> list[str]:
    """Replace each named nn.Linear with a LoraLinear, in place; freeze everything but the adapters.

    Call on the meta-device model before `apply_parallelism`. Returns the names wrapped.
    """
    model.requires_grad_(False)
    for name in module_names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA target {name} is a {type(base).__name__}, not an nn.Linear")
        setattr(parent, child, LoraLinear(base, rank, alpha))
    for module in lora_modules(model).values():
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
    return list(module_names)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Qualified name → LoraLinear, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full tensor into a parameter, keeping only this rank's shard of a DTensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full.to(param.dtype), param.device_mesh,
                                                     param.placements).to_local())
        else:
            param.copy_(full.to(param.dtype))


def init_lora_weights(model: nn.Module, seed: int = INIT_SEED) -> None:
    """A: Kaiming-uniform from one CPU generator in module order (every rank draws the same full
    tensors, so sharding does not change the draw); B: zeros, so B·A = 0 and the model is unchanged."""
    g = torch.Generator().manual_seed(seed)
    for module in lora_modules(model).values():
        a = torch.empty(module.rank, module.in_features)
        bound = math.sqrt(6.0 / ((1 + 5.0) * module.in_features))  # kaiming_uniform_(a=sqrt(5)), as nn.Linear
        a.uniform_(-bound, bound, generator=g)
        _fill(module.lora_A, a)
        _fill(module.lora_B, torch.zeros(module.out_features, module.rank))


@contextlib.contextmanager
def adapters_detached(model: nn.Module) -> Iterator[None]:
    """Hide the adapters from `model.state_dict()` for the duration (loading a base checkpoint, which
    has no adapter names); they are put back unchanged."""
    held = []
    for module in lora_modules(model).values():
        held.append((module, module._parameters.pop("lora_A"), module._parameters.pop("lora_B")))
    try:
        yield
    finally:
        for module, a, b in held:
            module._parameters["lora_A"] = a
            module._parameters["lora_B"] = b


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model for the duration: every LoraLinear computes its frozen layer alone, the same op and
    weights as the base model's own linear layer, so a LoRA policy is its own reference model (no copy)."""
    modules = list(lora_modules(model).values())
    for module in modules:
        module.adapters_on = False
    try:
        yield
    finally:
        for module in modules:
            module.adapters_on = True


def merged_weight(module: LoraLinear) -> torch.Tensor:
    """W + (alpha / rank) · B · A as a full fp32 tensor (a collective when the parameters are sharded)."""
    w, a, b = (full_value(t).detach().float() for t in (module.weight, module.lora_A, module.lora_B))
    return w + module.scaling * (b @ a)


def merge_lora(model: nn.Module) -> int:
    """Replace every LoraLinear of an unsharded model by an nn.Linear holding the merged weight (in the
    base weight's dtype); returns how many were merged. The model then has only base names."""
    merged = 0
    for name, module in list(lora_modules(model).items()):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           device=module.weight.device, dtype=module.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(merged_weight(module).to(module.weight.dtype))
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        setattr(parent, child, linear)
        merged += 1
    return merged


def lora_description(model: nn.Module) -> dict | None:
    """What a checkpoint records so the merge tool can rebuild the adapters: rank, alpha and the wrapped
    layers' names; None for a model without adapters."""
    modules = lora_modules(model)
    if not modules:
        return None
    first = next(iter(modules.values()))
    return {"rank": first.rank, "alpha": first.alpha, "modules": list(modules)}


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict key is an adapter (`...lora_A`, `...lora_B`), never sent to an engine."""
    return name.endswith((".lora_A", ".lora_B"))
