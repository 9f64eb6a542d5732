"""Distributed setup and the one function that applies parallelism to a model.

`ParallelDims` owns the device mesh; nothing else does rank arithmetic. `apply_parallelism`
applies, in this order: tensor parallel plan → activation checkpointing → FSDP2 (vision tower as
one unit, each decoder block as one unit (an MoE block's experts as a unit of their own first:
`FamilyAdapter.block_units`), then the root, which keeps embeddings, the final norm
and lm_head: lm_head runs once per logprob chunk, so it lives in the unit that stays gathered
for the whole forward).
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def allocator_settings(expandable_segments: bool) -> None:
    """Before CUDA starts (`parallel.expandable_segments`): add expandable_segments:True to torch's allocator
    settings, in the environment, where vLLM reads it too (its sleep-mode pool turns the setting off around
    itself). A setting the environment already names wins."""
    conf = os.environ.get(ALLOC_CONF, "")
    if not expandable_segments or "expandable_segments" in conf:
        return
    os.environ[ALLOC_CONF] = ",".join(part for part in (conf, "expandable_segments:True") if part)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # too late for the environment alone
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def init_distributed(backend: str = "auto") -> None:
    """Join torchrun's process group, or make a one-process group when run without torchrun."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))


def shutdown_distributed(clean: bool = True) -> None:
    """Tear the process groups down. After a clean run, first let garbage collection release the
    model's last asynchronous collectives and wait for every rank: a gloo worker thread still
    holding work when the interpreter finalizes aborts the process (seen at exit, rarely, in
    2-rank CPU runs). After a failure, no barrier: the other ranks may never arrive."""
    if not dist.is_initialized():
        return
    if clean:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


@dataclass
class ParallelDims:
    """The policy's device mesh: data parallel (FSDP, or HSDP: replicas × shards) × tensor parallel.

    With `replicate` > 1 the data-parallel ranks form `replicate` groups that each hold a full
    sharded copy (shards within a group, gradients all-reduced across groups): HSDP, with one
    group per node when `replicate` is the node count, so parameter all-gathers stay on the
    node's fast links. Data is split over all data-parallel ranks either way.
    """

    world_size: int
    tp: int
    device_type: str
    replicate: int = 1
    # parallel.one_device: how a policy that trains lives on one device (one rank, no tensor parallelism):
    # "fsdp" (FSDP units over a mesh of one) or "plain" (a plain module, `ComputeCopy`)
    one_device: str = "plain"

    def __post_init__(self):
        if self.world_size % self.tp:
            raise ValueError(f"parallel.tp={self.tp} does not divide the world size {self.world_size}")
        self.dp = self.world_size // self.tp
        if self.replicate < 1 or self.dp % self.replicate:
            raise ValueError(f"parallel.replicate={self.replicate} does not divide the {self.dp} data-parallel ranks")
        self.shard = self.dp // self.replicate
        dims = ([("dp_replicate", self.replicate)] if self.replicate > 1 else []) + [("dp_shard", self.shard)]
        dims += [("tp", self.tp)] if self.tp > 1 else []
        self.mesh = init_device_mesh(self.device_type, tuple(n for _, n in dims),
                                     mesh_dim_names=tuple(name for name, _ in dims))

    def describe(self) -> str:
        """One line for the log: the mesh in words."""
        if self.one_device_mesh and self.one_device == "plain":
            return f"{self.world_size} rank: one device, a plain module (parallel.one_device=plain)"
        dp = f"{self.replicate} replicas × {self.shard} shards (HSDP)" if self.replicate > 1 else f"{self.dp} (FSDP)"
        return f"{self.world_size} ranks: data parallel {dp}, tensor parallel {self.tp}"

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: 1-D (FSDP) or (replicate, shard) (HSDP)."""
        return self.mesh["dp_replicate", "dp_shard"] if self.replicate > 1 else self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.tp > 1 else None

    @property
    def one_device_mesh(self) -> bool:
        """One rank, no tensor parallelism: FSDP would shard over nothing."""
        return self.dp == 1 and self.tp == 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among all data-parallel ranks (which slice of the data it reads)."""
        shard = self.mesh["dp_shard"].get_local_rank()
        if self.replicate == 1:
            return shard
        return self.mesh["dp_replicate"].get_local_rank() * self.shard + shard

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.local_rank) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_replicate(replicate: int, world_size: int) -> int:
    """parallel.replicate: 0 means one replica per node (torchrun's LOCAL_WORLD_SIZE ranks each)."""
    if replicate:
        return replicate
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(world_size // max(local, 1), 1)


def build_parallel_dims(tp: int = 1, replicate: int = 1, one_device: str = "plain") -> ParallelDims:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    return ParallelDims(world_size=world, tp=tp, device_type=device_type,
                        replicate=resolve_replicate(replicate, world), one_device=one_device)


def _apply_tp(model: nn.Module, adapter, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in adapter.tp_plan().items()}
    text_cfg = getattr(model.config, "text_config", model.config)
    for heads in (text_cfg.num_attention_heads, text_cfg.num_key_value_heads):
        if heads % tp_mesh.size():
            raise ValueError(f"parallel.tp={tp_mesh.size()} does not divide the model's {heads} attention heads")
    for layer in adapter.decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)


def inductor_cache_dir() -> Path:
    """Where torch.compile's kernels for `model.compile` are kept: under XDG_CACHE_HOME or ~/.cache."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vlrl" / "inductor"


def apply_compile(layers) -> None:
    """torch.compile each decoder block's `forward` in place (names, hooks and FSDP units unchanged).

    Only `forward` is compiled, so FSDP's and activation checkpointing's hooks around it run as
    they do without compiling. Packed rows change length every micro-batch: shapes are dynamic.
    The attention call reads the packed row's boundaries from a context variable and runs between
    the compiled regions. Inductor's compiled kernels are kept in the user's cache
    (`~/.cache/vlrl/inductor`, unless TORCHINDUCTOR_CACHE_DIR is set) rather than its default under
    /tmp, so a later run on the machine reuses them.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


class ComputeCopy:
    """Mixed precision on one device without FSDP (`parallel.one_device=plain`): the module keeps its fp32 master
    parameters, which the optimizer steps and checkpoints hold; a forward swaps in a copy of each in the compute
    dtype, made once and kept until `release`, and the copies' gradients are added into the masters' in fp32 as a
    backward makes them: group by group (the units FSDP would make: the vision tower, each decoder block, the
    rest), once every trainable copy of the group has its gradient, so no more than a group's gradients wait in
    the compute dtype; `accumulate` adds what a backward left (a group it did not reach whole). The numbers FSDP's
    mixed precision gives with one rank and its gradients held between micro-batches: the same casts, the fp32
    gradient summed in the same order."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, groups: list[nn.Module]):
        self.dtype = dtype
        self.slots = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
        self.masters = list({id(p): p for _, _, p in self.slots}.values())  # tied parameters once
        owner: dict[int, int] = {}
        for i, group in enumerate(groups):  # inner groups first: each claims its parameters before an outer one
            for p in group.parameters():
                owner.setdefault(id(p), i)
        self.group_of = {id(p): owner.get(id(p), len(groups)) for p in self.masters}
        self.groups = [[p for p in self.masters if p.requires_grad and self.group_of[id(p)] == i]
                       for i in range(len(groups) + 1)]
        self.arrived = [0] * len(self.groups)
        self.copies: dict[int, nn.Parameter] | None = None

    @property
    def active(self) -> bool:
        return self.copies is not None

    def gradient_bytes(self) -> int:
        """The most the copies' gradients hold at once in a backward (the memory plan's gradient buffers): the two
        largest groups' (a block's wait for the block's last; the rest's, the lm_head's first and the embedding's
        last, through the whole backward; the tower's through its own)."""
        sizes = sorted((sum(p.numel() for p in group) for group in self.groups), reverse=True)
        return sum(sizes[:2]) * torch.finfo(self.dtype).bits // 8

    def swap_in(self) -> None:
        """The compute copies in the modules, made from the masters now if they are not there."""
        if self.copies is not None:
            return
        copies = {}
        with torch.no_grad():  # one buffer, filled by one foreach copy (each view rounded as `.to` rounds)
            floating = [p for p in self.masters if p.is_floating_point()]
            flat = torch.empty(sum(p.numel() for p in floating), dtype=self.dtype, device=floating[0].device)
            views = [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in floating]), floating)]
            torch._foreach_copy_(views, floating)
            made = {id(p): v for p, v in zip(floating, views)}
            for p in self.masters:
                c = nn.Parameter(made.get(id(p), p), requires_grad=p.requires_grad)
                if p.requires_grad:
                    c.register_post_accumulate_grad_hook(self._hook(self.group_of[id(p)]))
                copies[id(p)] = c
        self.copies = copies
        for module, name, p in self.slots:
            module._parameters[name] = copies[id(p)]

    def _hook(self, group: int):
        def arrived(_copy: torch.Tensor) -> None:
            self.arrived[group] += 1
            if self.arrived[group] == len(self.groups[group]):
                self._add(self.groups[group])
                self.arrived[group] = 0
        return arrived

    def _add(self, masters: list[torch.Tensor]) -> None:
        pairs = [(p, c) for p, c in ((p, self.copies[id(p)]) for p in masters) if c.grad is not None]
        held = [(p, c) for p, c in pairs if p.grad is not None]
        with torch.no_grad():
            if held:
                torch._foreach_add_([p.grad for p, _ in held], [c.grad for _, c in held])
            for p, c in pairs:
                if p.grad is None:
                    p.grad = c.grad.to(p.dtype)
                c.grad = None

    def accumulate(self) -> None:
        """Whatever gradients the copies still hold, added into the masters' (made on the first) in fp32."""
        if self.copies is None:
            return
        self._add([p for group in self.groups for p in group])
        self.arrived = [0] * len(self.groups)

    def release(self) -> None:
        """The masters back in the modules, with every gradient the copies had; the copies freed."""
        if self.copies is None:
            return
        self.accumulate()
        for module, name, p in self.slots:
            module._parameters[name] = p
        self.copies = None


def local_tensors(tensors: list) -> list | None:
    """The local tensors of `tensors` where each is a plain tensor or a DTensor on a mesh of one device (one rank,
    no tensor parallelism: its local tensor is its whole value, whatever the placement), else None. Taken
    without autograd, which would wrap each in a tracked view (~10 us a tensor)."""
    meshes = {id(m): m for m in (t.device_mesh for t in tensors if isinstance(t, DTensor))}  # one or two meshes
    if not all(m.size() == 1 for m in meshes.values()):
        return None
    with torch.no_grad():
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh); a plain tensor as it is. On a mesh of one device the
    local tensor itself (`local_tensors`): DTensor's gather costs ~0.1 ms of host time a tensor there (`python
    tools/host_cost.py --parts refit`) and copies every tensor first."""
    local = local_tensors([t])
    return local[0] if local is not None else t.full_tensor()


def apply_parallelism(
    model: nn.Module,
    adapter,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype | None,
    activation_checkpointing: bool,
    trainable: bool = True,
    compile_blocks: bool = False,
) -> nn.Module:
    """TP plan → activation checkpointing → FSDP2 units; returns the model (sharded in place).

    On GPU, parameters stay fp32 (the sharded master copy), compute runs in `param_dtype` and
    gradients reduce in fp32. On CPU everything is fp32.

    Units: the vision tower, each decoder block (and a MoE block's experts), then the root.

    On one device (one rank, no tensor parallelism) a frozen model (the reference, stored in the compute dtype
    by its caller) is left a plain module: FSDP would hold a second copy of every weight for each pass and run
    its hooks around every unit in every micro-batch, and share nothing. So is a model that trains there with
    `parallel.one_device=plain` (its caller adds a `ComputeCopy`). Each would-be unit casts its floating inputs
    to the compute dtype, as FSDP's mixed precision does (tests/test_gathered_passes.py: the same logprobs, bit
    for bit, in every family).
    """
    if dims.tp_mesh is not None:
        _apply_tp(model, adapter, dims.tp_mesh)
    if activation_checkpointing:
        from models.attention import checkpoint_context

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})
    if compile_blocks:
        apply_compile(adapter.decoder_layers(model))
    if dims.one_device_mesh and (not trainable or dims.one_device == "plain"):
        if param_dtype is not None:
            for unit in unit_modules(model, adapter)[:-1]:  # the root gets the micro-batch: its pixels reach the tower
                unit.register_forward_pre_hook(_inputs_in(param_dtype), with_kwargs=True)
        return model
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    # With one data-parallel rank nothing is sharded: keeping each unit's low-precision copy from
    # forward to backward saves re-casting every parameter in backward, for one model-sized copy.
    # A frozen model (the reference) has no backward to free that copy, so it reshards always.
    kwargs = {"mesh": dims.dp_mesh, "reshard_after_forward": dims.dp_mesh.size() > 1 or not trainable}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for unit in unit_modules(model, adapter):
        fully_shard(unit, **kwargs)
    return model


def unit_modules(model: nn.Module, adapter) -> list[nn.Module]:
    """The FSDP units, inner ones first: the vision tower, each decoder block's own units (a MoE block's experts,
    gathered on their own) and the block, then the root."""
    units = [adapter.vision_tower(model)]
    for layer in adapter.decoder_layers(model):
        units += [*adapter.block_units(layer), layer]
    return units + [model]


def _inputs_in(dtype: torch.dtype):
    """A forward pre-hook that casts a module's floating inputs to `dtype`, as FSDP's mixed precision does at each
    unit's entry (a tower's position-interpolation weights, say, which it gets in fp32)."""

    def cast(x):
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            values = [cast(v) for v in x]
            return type(x)(*values) if hasattr(x, "_fields") else type(x)(values)
        return x

    def hook(module, args, kwargs):
        return cast(args), cast(kwargs)

    return hook
