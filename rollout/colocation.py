"""Colocation: the policy and the engine taking turns on each rank's GPU, as one object.

`Colocation` owns everything the two halves share: the memory plan made once at start, the
engine (built on first use with the plan's share of the device), waking it for generation and
putting it back to sleep, offloading the policy state the plan says does not fit beside it, and
refitting the engine whenever the policy has moved. The trainer's step uses it as

    with colocation.generating() as engine:     # wake (offload first, if planned) ... sleep
        generations = engine.generate(...)
    ... score, logprobs, update ...
    colocation.policy_updated()                  # the engine's weights are now stale
    colocation.refit()                           # stream the new weights into the engine

The memory plan (`plan_memory`) works out what the policy needs on the device: its parameters,
gradients, optimizer state, a reference model, and the peak activations of the configured
micro-batch. During generation gradients do not exist (the update frees them), so the engine
gets what the resident state leaves; only what does not fit beside the engine leaves the GPU,
optimizer state before parameters. During training the engine sleeps and the policy has the
device, so the plan also checks the training peak fits then.

What lives when, with one data-parallel rank and optim.unsharded_accumulation (grpo/update.py
`optimizer_step`, torch's FSDP2 `FSDPParamGroup.post_backward` and `foreach_reduce`, as read in
torch 2.13):
- micro-batches before the last (`set_requires_gradient_sync(False)`,
  `set_reshard_after_backward(False)`): every unit keeps its low-precision compute copy
  (`compute_copy`) and an fp32 unsharded gradient, `FSDPParam.unsharded_accumulated_grad`, made by
  `to_accumulated_grad_if_needed` from the bf16 gradient and summed into by
  `accumulate_unsharded_grad_if_needed` (as large as the fp32 parameters: `gradients`);
- the last micro-batch reduces and reshards unit by unit: the unit's fp32 gradient is copied into
  a reduce buffer of the unit's size and dropped (`unsharded_grads.clear()`), the sharded gradient
  is a new fp32 buffer (one rank: the unit's size again) and the compute copy is freed. So beyond
  `gradients` the update holds one unit's gradient in the compute dtype and its reduce buffer
  (`grad_buffers`), never a second full copy of the gradients;
- after the step `optimizer.zero_grad(set_to_none=True)` drops the sharded gradients; every unit
  is resharded; `Colocation.generating` reshards again (a forward without backward keeps the copy)
  and empties torch's cache before the engine wakes. Between steps only the parameters, the
  optimizer state and the reference live (tests/test_unsharded_accumulation.py counts the live
  tensors after a held step on CPU).
The device may still show more than that during generation: `torch.cuda.empty_cache` returns only
segments with no live block, and a segment holding one keeps its free part (AdamW's state made by the
first step is cut from blocks the update cached, unless optim.allocate_state_at_start). `DevicePeak`
reports that part (`memory/inactive_split_gb_generation`) and, per pass, the allocator's retries and
growth; during generation the engine's own retries, driver allocations and frees (`memory/*_generation`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal

import torch

from models.flops import output_gated, text_config
from models.policy import LOGPROB_CHUNK
from rollout.base import Engine

log = logging.getLogger("vlrl")
_GIB = 2**30
# the allocator's counts a pass (or the awake engine) is charged with: metric name -> torch.cuda.memory_stats key;
# they add up when a pass runs twice in a step (the other per-pass metrics keep the larger)
_COUNTS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
           "device_frees": "num_device_free"}

RESERVE_BYTES = 3 * _GIB  # allocator fragmentation and slack, beyond what the CUDA context already holds
ENGINE_OVERHEAD_BYTES = 4 * _GIB  # vLLM's activations, sampler and CUDA graphs (measured 1.5 GiB, 3B on an H200)
ENGINE_ASLEEP_BYTES = 1 * _GIB  # what a sleeping vLLM keeps (measured 0.79 GiB on an H200)
MAX_ENGINE_SHARE = 0.9
KV_HEADROOM = 1.1  # beyond max_num_seqs full-length sequences (block rounding)
KV_MINIMUM_FRACTION = 4

Offload = Literal["none", "optimizer", "optimizer+parameters"]


@dataclass
class MemoryNeeds:
    """Bytes per GPU that each piece of the colocated step takes (inputs to `plan_memory`)."""

    device: int
    parameters: int  # the policy's local parameter shards (fp32 master copy on GPU)
    gradients: int  # as large as the parameters; exist only during the update
    optimizer: int  # AdamW: two moments as large as the parameters
    reference: int = 0  # a frozen reference policy, if any
    compute_copy: int = 0  # unsharded low-precision parameters held during forward/backward
    # one FSDP unit's gradient in the compute dtype and its fp32 reduce buffer, beside `gradients` in backward
    grad_buffers: int = 0
    activations: int = 0  # peak activations of one micro-batch (training only)
    microbatch_tokens: int = 0  # optim.max_tokens_per_microbatch, the size `activations` is for
    engine_weights: int = 0
    engine_kv_wanted: int = 0  # the most KV the engine can use: max_num_seqs full-length sequences
    reserve: int = RESERVE_BYTES


@dataclass
class MemoryPlan:
    """What stays on the GPU during generation, what leaves it, and the engine's share."""

    needs: MemoryNeeds
    offload: Offload
    gpu_memory_utilization: float
    explicit: bool = False  # the share came from rollout.gpu_memory_utilization, not the plan
    warnings: list[str] = field(default_factory=list)

    @property
    def offload_optimizer(self) -> bool:
        return self.offload != "none"

    @property
    def offload_parameters(self) -> bool:
        return self.offload == "optimizer+parameters"

    @property
    def resident_during_generation(self) -> int:
        n = self.needs
        return (0 if self.offload_parameters else n.parameters + n.reference) + \
            (0 if self.offload_optimizer else n.optimizer)

    @property
    def engine_bytes(self) -> int:
        return int(self.gpu_memory_utilization * self.needs.device)

    @property
    def training_peak(self) -> int:
        n = self.needs
        return (n.parameters + n.gradients + n.optimizer + n.reference + n.compute_copy + n.grad_buffers
                + n.activations)

    def lines(self) -> list[str]:
        """One line per item, for the start-up log."""
        n, g = self.needs, lambda b: f"{b / _GIB:6.1f} GiB"
        where_opt = "offloaded to CPU during generation" if self.offload_optimizer else "resident"
        where_par = "offloaded to CPU during generation" if self.offload_parameters else "resident"
        share = "rollout.gpu_memory_utilization (explicit)" if self.explicit else "what the resident state leaves"
        out = [
            f"memory plan, per GPU of {n.device / _GIB:.1f} GiB:",
            f"  policy parameters        {g(n.parameters)}  {where_par}",
            f"  gradients                {g(n.gradients)}  training only (freed after each update)",
            f"  optimizer state          {g(n.optimizer)}  {where_opt}",
        ]
        if n.reference:
            out.append(f"  reference model          {g(n.reference)}  {where_par}")
        if n.compute_copy:
            out.append(f"  unsharded compute copy   {g(n.compute_copy)}  training only")
        if n.grad_buffers:
            out.append(f"  gradient reduce buffers  {g(n.grad_buffers)}  training only (the largest FSDP unit's)")
        out += [
            f"  activations (peak)       {g(n.activations)}  training only (estimate for one micro-batch)",
            f"  reserve                  {g(n.reserve)}  CUDA context, communication buffers, fragmentation",
            f"  engine                   {g(self.engine_bytes)}  gpu_memory_utilization={self.gpu_memory_utilization:.3f}"
            f" ({share}; weights {n.engine_weights / _GIB:.1f} GiB, KV for the widest batch "
            f"{n.engine_kv_wanted / _GIB:.1f} GiB)",
            f"  training peak            {g(self.training_peak)}  of {(n.device - ENGINE_ASLEEP_BYTES - n.reserve) / _GIB:.1f}"
            " GiB while the engine sleeps",
        ]
        return out + [f"  warning: {w}" for w in self.warnings]


def _engine_floor(n: MemoryNeeds) -> int:
    """All the engine can use: weights, overhead and the widest batch's KV cache."""
    return n.engine_weights + ENGINE_OVERHEAD_BYTES + n.engine_kv_wanted


def _engine_minimum(n: MemoryNeeds) -> int:
    """Less than this and offloading policy state is worth its copies: a quarter of the widest batch's KV
    (max_model_len counts the longest prompt; a step's prompts are rarely all that long)."""
    return n.engine_weights + ENGINE_OVERHEAD_BYTES + n.engine_kv_wanted // KV_MINIMUM_FRACTION


def plan_memory(needs: MemoryNeeds, *, offload: Literal["auto", "on", "off"] = "auto",
                gpu_memory_utilization: float = 0.0) -> MemoryPlan:
    """The colocation plan: keep as much policy state resident as the engine leaves room for.

    `offload` is parallel.offload_during_generate: `on` moves optimizer state and parameters off
    the GPU for every generation, `off` never, `auto` moves only what does not fit (optimizer
    state first). `gpu_memory_utilization` > 0 fixes the engine's share (an explicit override);
    0 gives the engine what the resident state and the reserve leave, up to what it can use (its
    weights, overhead and the KV cache of max_num_seqs full-length sequences) and 90% of the device:
    KV cache beyond what the scheduler can fill only lengthens wake-up and narrows the margin.
    """
    explicit = gpu_memory_utilization > 0
    choices: list[Offload] = {"on": ["optimizer+parameters"], "off": ["none"]}.get(
        offload, ["none", "optimizer", "optimizer+parameters"])
    plan = None
    for choice in choices:
        plan = MemoryPlan(needs, choice, 0.0, explicit)
        left = needs.device - plan.resident_during_generation - needs.reserve
        if explicit:
            plan.gpu_memory_utilization = gpu_memory_utilization
            fits = plan.engine_bytes <= left
        else:
            usable = min(left, _engine_floor(needs))
            plan.gpu_memory_utilization = max(min(usable / needs.device, MAX_ENGINE_SHARE), 0.0)
            fits = left >= _engine_minimum(needs)
        if fits:
            break
    else:
        plan.warnings.append(
            f"the engine's share ({plan.engine_bytes / _GIB:.1f} GiB) and the resident policy state "
            f"({plan.resident_during_generation / _GIB:.1f} GiB) do not fit the device with "
            f"parallel.offload_during_generate={offload}; generation may run out of memory"
        )
    if not explicit and plan.engine_bytes < _engine_minimum(needs):
        plan.warnings.append(
            f"the engine gets {plan.engine_bytes / _GIB:.1f} GiB, less than its weights, overhead and a quarter of "
            f"the widest batch's KV cache ({_engine_minimum(needs) / _GIB:.1f} GiB): generation will queue requests"
        )
    room = needs.device - ENGINE_ASLEEP_BYTES - needs.reserve
    if plan.training_peak > room:
        state = plan.training_peak - needs.activations
        if state >= room:
            fix = ("the policy's state alone does not fit: set model.lora.rank, or spread the policy over more "
                   "GPUs")
        else:
            fits = ""
            if needs.activations and needs.microbatch_tokens:  # activations grow with the micro-batch's tokens
                tokens = needs.microbatch_tokens * (room - state) // needs.activations // 256 * 256
                fits = f" (about {tokens} fits)" if tokens > 0 else ""
            fix = f"lower optim.max_tokens_per_microbatch{fits} or set model.activation_checkpointing=true"
        plan.warnings.append(
            f"training needs ~{plan.training_peak / _GIB:.1f} GiB but ~{room / _GIB:.1f} GiB is free while the "
            f"engine sleeps: {fix}"
        )
    return plan


# --- estimates from the model's shape -------------------------------------------------------------
DELTA_RULE_CHUNK = 64  # flash-linear-attention's chunk: the gated delta rule keeps a chunk-local matrix per token


def _mlp_values(t) -> int:
    """Values per token an MLP block keeps for backward: gate, up, activation and product (a MoE block:
    those of each routed expert and the shared expert, and the router's fp32 logits)."""
    experts = getattr(t, "num_experts", 0) or 0
    if experts and getattr(t, "moe_intermediate_size", 0):
        shared = getattr(t, "shared_expert_intermediate_size", 0) or 0
        return 4 * (t.moe_intermediate_size * t.num_experts_per_tok + shared) + 2 * experts
    return 4 * (getattr(t, "intermediate_size", None) or 4 * t.hidden_size)


def layer_activation_values(t, kind: str) -> int:
    """Values per token one decoder layer of a hybrid (linear + full attention) text config keeps for backward.

    Both kinds: the two norms' inputs and outputs, and the MLP. A full-attention layer (Qwen3.5 /
    Qwen3-Next: q/k norms, a partial rotary, and q_proj twice as wide for the output gate) keeps q in
    fp32 for its norm, normed and rotated, the attention output, and the gate's sigmoid and product;
    k the same with its own heads, and v. A Gated DeltaNet layer keeps the q/k/v projection (the
    convolution's input), the packed path's K-1 shifted copies of it (`restarting_causal_conv`), the
    convolution's output and activation, q and k repeated to the value heads and l2-normed, the delta
    rule's chunk-local matrix and gates, and the gated norm's fp32 copies of the core output and of
    z, the silu of z, and its normed, weighted and gated outputs.
    """
    h = t.hidden_size
    common = 4 * h + _mlp_values(t)
    if kind == "linear_attention":
        nk, nv = t.linear_num_key_heads, t.linear_num_value_heads
        dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
        conv = 2 * nk * dk + nv * dv
        width = getattr(t, "linear_conv_kernel_dim", 4)
        return (common + conv * (width + 2) + 2 * nv * dk + DELTA_RULE_CHUNK * nv + 6 * nv
                + 9 * nv * dv)
    heads = t.num_attention_heads
    head = getattr(t, "head_dim", None) or h // heads
    q, kv = heads * head, (getattr(t, "num_key_value_heads", None) or heads) * head
    return common + q * (7 if output_gated(t) else 5) + 5 * kv


def activation_bytes(config, tokens: int, checkpointing: bool, dtype_bytes: int = 2) -> int:
    """Peak activation bytes of a forward/backward over a packed row of `tokens` tokens.

    Per token and decoder layer, a SwiGLU block with FlashAttention keeps about (8·hidden +
    4·intermediate) values for backward (norm inputs and outputs, q/k/v, attention output,
    gate/up/activation/product); a config whose `layer_types` name linear-attention layers counts
    each layer by its kind (`layer_activation_values`: Gated DeltaNet layers keep several times
    more). With activation checkpointing only each layer's input stays, plus one layer recomputed
    at a time. The lm_head runs in checkpointed chunks (models/policy.py): one chunk's fp32 logits,
    their gradient and two fp32 working copies. An estimate that errs high.
    """
    t = text_config(config)
    h, layers = t.hidden_size, t.num_hidden_layers
    kinds = list(getattr(t, "layer_types", None) or [])
    if "linear_attention" in kinds:
        per_layer = [layer_activation_values(t, kind) * dtype_bytes for kind in kinds[:layers]]
    else:
        inter = getattr(t, "intermediate_size", None) or 4 * h
        per_layer = [(8 * h + 4 * inter) * dtype_bytes] * layers
    logits = min(tokens, LOGPROB_CHUNK) * (getattr(t, "vocab_size", 0) or 0) * 16
    if checkpointing:
        return tokens * (layers * h * dtype_bytes + max(per_layer)) + logits
    return tokens * sum(per_layer) + logits


def fsdp_unit_sizes(model) -> list[tuple[int, int]]:
    """(parameters, trainable parameters) of each FSDP unit's own parameters (those of no unit inside
    it), full sizes; a model without units is one unit."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)] or [model]
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):  # outer units come first in modules(): inner ones claim theirs after
        for p in unit.parameters():
            owner[id(p)] = i
    sizes = [[0, 0] for _ in units]
    for p in model.parameters():
        i = owner.get(id(p))
        if i is not None:
            sizes[i][0] += p.numel()
            sizes[i][1] += p.numel() if p.requires_grad else 0
    return [tuple(s) for s in sizes]


def kv_heads(text: dict) -> int:
    return text.get("num_key_value_heads") or text["num_attention_heads"]


def layer_kv_shape(text: dict, index: int) -> tuple[int, int]:
    """(KV heads, head size) of decoder layer `index` of a text config dict: the layer's own entry in
    `per_layer_config` (transformers' per-layer overrides) first, then Gemma4's full-attention
    `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`, then the config's."""
    # keys are layer indices, written as strings zero-padded to the widest one ("04" among 12 layers)
    overrides = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    own = overrides.get(index) or {}
    types = text.get("layer_types") or []
    full = index < len(types) and types[index] == "full_attention"
    head = own.get("head_dim") or (full and text.get("global_head_dim")) or text.get("head_dim") \
        or text["hidden_size"] // text["num_attention_heads"]
    heads = own.get("num_key_value_heads") or (full and text.get("attention_k_eq_v") and
                                               text.get("num_global_key_value_heads")) or kv_heads(text)
    return heads, head


def kv_bytes_per_token(config: dict, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """K and V bytes one token takes over all decoder layers (an upper bound for sliding layers), per
    GPU of a tensor-parallel engine: TP splits the KV heads (more GPUs than heads replicate them).
    `config` is config.json's dict. Each layer counts its own head size and KV heads
    (`layer_kv_shape`); the last `num_kv_shared_layers` read an earlier layer's cache and add none;
    linear-attention layers add none either (their state is per sequence: `state_bytes_per_sequence`)."""
    text = config.get("text_config", config)
    types = text.get("layer_types") or []
    total = 0
    for index in range(text["num_hidden_layers"] - (text.get("num_kv_shared_layers") or 0)):
        if index < len(types) and types[index] == "linear_attention":
            continue
        heads, head = layer_kv_shape(text, index)
        total += 2 * heads * head * dtype_bytes // max(1, min(tensor_parallel_size, heads))
    return total


def state_bytes_per_sequence(config: dict, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """The fixed state one sequence keeps in a hybrid's linear-attention layers, per GPU of a tensor-parallel
    engine (TP splits the heads): the short convolution's last K-1 inputs (2·key heads·key width + value
    heads·value width channels) in the model dtype and the recurrent state (value heads × key width × value
    width) in the config's `mamba_ssm_dtype` where it names one (released Qwen3.5 configs: float32), else the
    model's, as vLLM keeps them for Gated DeltaNet. 0 for a config without such layers."""
    text = config.get("text_config", config)
    layers = sum(1 for kind in (text.get("layer_types") or []) if kind == "linear_attention")
    if not layers:
        return 0
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    kd, vd = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (2 * nk * kd + nv * vd) * (text.get("linear_conv_kernel_dim", 4) - 1)
    named = text.get("mamba_ssm_dtype")
    state_bytes = getattr(torch, named).itemsize if named else dtype_bytes
    recurrent = nv * kd * vd
    return layers * (conv * dtype_bytes + recurrent * state_bytes) // max(1, min(tensor_parallel_size, nk))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    """Local bytes of parameters or state tensors (a DTensor counts its local shard)."""
    return sum(local.numel() * local.element_size() for local in map(_local, tensors))


def tensor_elements(tensors) -> int:
    """Local elements of parameters or state tensors (a DTensor counts its local shard)."""
    return sum(_local(t).numel() for t in tensors)


# --- the device's peak ---------------------------------------------------------------------------
class DevicePeak:
    """This process's peak device memory over a step, in GiB, and where torch's allocator struggled.

    torch's allocator statistics alone overstate it: a sleeping vLLM engine's tensors stay in
    torch's books while their memory is unmapped, and its memory pool comes and goes with sleep
    and wake, so `max_memory_allocated` read 160-190 GiB on a 140 GiB H200. The peak here is the
    device's used memory sampled at the step's start and while the engine is awake (`sample`),
    and, around the policy's passes (`training`, while the engine sleeps), the device's used
    memory at their start plus the growth of torch's reserved segments during them. (Counting
    the growth of allocated bytes instead counted the allocator's cached blocks twice: they are
    in the used memory already, and a pass allocates from them first; it read 140.2 GiB on a
    139.8 GiB H200.)

    A labelled pass also records, as `phase_metrics` (for the same reason, as growth over the pass's
    start where the sleeping engine's tensors would count): the allocator's retries during it (each
    frees the whole cache and waits for the device), how far its reserved and its allocated bytes
    grew (reserved beyond allocated is what the cache kept and could not reuse), and the most
    bytes held in free pieces of segments with live blocks (`inactive_split`: the allocator can
    neither return them nor serve a larger block from them). `before_wake` records that last
    measure once the cache is emptied for the engine: what training leaves stranded during
    generation.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._peak = 0
        self._retries = 0
        self._phases: dict[str, float] = {}
        # the training pass running now: a pass that raised keeps its label, so whoever catches the error can
        # name the pass (None outside them: generation, scoring, the refit)
        self.pass_label: str | None = None

    def _used(self) -> int:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _stats(self) -> dict:
        return torch.cuda.memory_stats(self.device)

    def begin(self) -> None:
        self._peak = self._used() if self._cuda else 0
        self._retries = self._retry_count()
        self._phases = {}
        self.pass_label = None

    def _retry_count(self) -> int:
        return int(self._stats().get("num_alloc_retries", 0)) if self._cuda else 0

    def alloc_retries(self) -> float:
        """How often torch's allocator found the device full since `begin`, freed its cached blocks and tried
        again (each retry synchronizes the device: a step near the device's size pays for it)."""
        return float(self._retry_count() - self._retries)

    def sample(self) -> None:
        if self._cuda:
            self._peak = max(self._peak, self._used())

    def before_wake(self) -> None:
        """After the cache is emptied for the engine: the bytes torch still holds in free pieces of segments
        that live blocks keep (`memory/inactive_split_gb_generation`)."""
        if self._cuda:
            self._phases["memory/inactive_split_gb_generation"] = \
                self._stats().get("inactive_split_bytes.all.current", 0) / _GIB

    @contextmanager
    def training(self, label: str | None = None) -> Iterator[None]:
        """Around passes that allocate only through torch's caching allocator (the engine asleep); with a
        `label` ("logprob", "update"), the pass's allocator metrics too."""
        self.pass_label = label or "training"
        if not self._cuda:
            yield
            self.pass_label = None
            return
        used, start = self._used(), self._stats()
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
            self.pass_label = None
        finally:
            end = self._stats()
            reserved = start.get("reserved_bytes.all.current", 0)
            grown = max(end.get("reserved_bytes.all.peak", 0) - reserved, 0)
            self._peak = max(self._peak, used + grown)
            if label:
                self._record(label, start, end, grown)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around the awake engine's calls: the allocator's retries, driver allocations and frees meanwhile
        (`memory/alloc_retries_generation`, `device_allocs_generation`, `device_frees_generation`, summed over a
        step's calls). The engine's activations and sampler buffers come from torch's caching allocator: next to
        a full device each allocation the cache cannot serve is a driver call, a retry or free waits for the
        device, and the engine's steps slow down."""
        if not self._cuda:
            yield
            return
        start = self._stats()
        try:
            yield
        finally:
            self._add_counts("generation", start, self._stats())

    def _add_counts(self, label: str, start: dict, end: dict) -> None:
        """The allocator's counts between two `memory_stats` readings, added to the step's `memory/<count>_<label>`."""
        for name, key in _COUNTS.items():
            metric = f"memory/{name}_{label}"
            self._phases[metric] = self._phases.get(metric, 0.0) + float(end.get(key, 0) - start.get(key, 0))

    def _record(self, label: str, start: dict, end: dict, grown: int) -> None:
        """A pass's allocator metrics; a label seen again in the step adds its counts (`_add_counts`: retries, and
        the driver allocations and frees) and keeps the larger growth."""
        allocated = max(end.get("allocated_bytes.all.peak", 0) - start.get("allocated_bytes.all.current", 0), 0)
        values = {
            f"memory/reserved_growth_gb_{label}": grown / _GIB,
            f"memory/allocated_growth_gb_{label}": allocated / _GIB,
            f"memory/inactive_split_gb_{label}": end.get("inactive_split_bytes.all.peak", 0) / _GIB,
        }
        for key, value in values.items():
            self._phases[key] = max(self._phases.get(key, value), value)
        # the driver allocations (cudaMalloc, or cuMemMap with expandable segments) the pass made: a pass that
        # regrows the cache the engine's wake emptied pays for each, where a warm cache makes none; and the frees
        # (each cudaFree waits for the device): a retry's; with `max_split_size_mb` or
        # `garbage_collection_threshold` set, also the cached blocks the allocator frees before it retries
        self._add_counts(label, start, end)

    def phase_metrics(self) -> dict[str, float]:
        """The labelled passes' allocator metrics since `begin` (none on CPU)."""
        return dict(self._phases)

    def end(self) -> float:
        """The step's peak in GiB (on CPU: the process's peak resident memory)."""
        if not self._cuda:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self.sample()
        return self._peak / _GIB


# --- the colocation object ----------------------------------------------------------------------
class Colocation:
    """Owns the engine's life on this rank: the memory plan, wake/sleep, offload/reload, refit.

    `build_engine(gpu_memory_utilization)` makes the engine (called once, on first use, after the
    plan). `needs` is a callable returning this rank's `MemoryNeeds` (called once, on first use).
    """

    def __init__(self, policy, optimizer: torch.optim.Optimizer, *, build_engine: Callable[[float], Engine],
                 needs: Callable[[], MemoryNeeds] | None, offload: str = "auto", gpu_memory_utilization: float = 0.0,
                 reference=None, agree: Callable[[int], int] = lambda v: v, is_main: bool = True):
        self.policy = policy
        self.optimizer = optimizer
        self.reference = reference
        self._build_engine = build_engine
        self._needs = needs
        self._offload_mode = offload
        self._utilization = gpu_memory_utilization
        self._agree = agree  # all-reduce max across ranks, so every rank takes the same decision
        self._is_main = is_main
        self.engine: Engine | None = None
        self.plan: MemoryPlan | None = None
        self.policy_version = 0  # optimizer updates applied to the policy in this process
        self.engine_version = -1  # the policy version whose weights the engine holds
        self.timings: dict[str, float] = {}
        self.refit_timings: dict[str, float] = {}  # the last refit's parts (`refit`)
        self._gpu = policy.device.type == "cuda"
        self.peak = DevicePeak(policy.device)

    # --- start-up ------------------------------------------------------------------------------
    def make_plan(self) -> MemoryPlan | None:
        """The plan, made once (on a GPU; on CPU there is nothing to share)."""
        if self.plan is None and self._gpu and self._needs is not None:
            plan = plan_memory(self._needs(), offload=self._offload_mode,
                               gpu_memory_utilization=self._utilization)
            # every rank offloads alike (an FSDP collective must not meet a rank whose shards moved)
            level = self._agree(["none", "optimizer", "optimizer+parameters"].index(plan.offload))
            plan.offload = ["none", "optimizer", "optimizer+parameters"][level]
            self.plan = plan
            if self._is_main:
                print("\n".join(plan.lines()), flush=True)
        return self.plan

    def ensure_engine(self) -> Engine:
        """The engine, built on first use with the plan's share and refit if the policy has moved."""
        if self.engine is None:
            plan = self.make_plan()
            if self._gpu:
                torch.cuda.empty_cache()  # memory cached from training would count as taken to vLLM
            self.engine = self._build_engine(plan.gpu_memory_utilization if plan else self._utilization)
        if self.engine_version != self.policy_version:
            self.refit()
        return self.engine

    # --- the phases ------------------------------------------------------------------------------
    @contextmanager
    def generating(self) -> Iterator[Engine]:
        """The engine awake and current for the block; afterwards asleep, the policy state back."""
        engine = self.ensure_engine()
        time_slice = self._gpu
        t = time.monotonic()
        self._move_policy_state(to_cpu=True)
        if time_slice:
            self.policy.reshard()
            if self.reference is not None:
                self.reference.reshard()
            torch.cuda.empty_cache()  # what training cached goes back before the engine wakes
            self.peak.before_wake()
        offload_s = time.monotonic() - t
        t = time.monotonic()
        if time_slice:
            engine.wake()
        wake_s = time.monotonic() - t
        self.peak.sample()
        try:
            with self.peak.generating():
                yield engine
        finally:
            self.peak.sample()
            t = time.monotonic()
            if time_slice:
                engine.sleep()
                if engine.sleep_discards_weights:
                    self.engine_version = -1  # what it held is gone: the next generation refits first
            sleep_s = time.monotonic() - t
            t = time.monotonic()
            self._move_policy_state(to_cpu=False)
            reload_s = time.monotonic() - t
            self.timings = {"perf/wake_s": wake_s, "perf/sleep_s": sleep_s, "perf/offload_s": offload_s + reload_s}

    def _move_policy_state(self, to_cpu: bool) -> None:
        """Offload (or bring back) what the plan says leaves the GPU while the engine generates."""
        plan = self.plan
        if plan is None:
            return
        if plan.offload_parameters:
            for p in (self.policy, self.reference):
                if p is not None:
                    p.offload(None) if to_cpu else p.reload(None)
        if plan.offload_optimizer:
            if to_cpu:
                self.policy.offload_optimizer(self.optimizer)
            else:
                self.policy.reload_optimizer(self.optimizer)

    def policy_updated(self, steps: int = 1) -> None:
        """The policy took `steps` optimizer steps: the engine's weights are stale until `refit`."""
        self.policy_version += steps

    def refit(self) -> float:
        """Stream the policy's full weights into the engine (in the engine's dtype); returns seconds. Where they
        went, in `refit_timings`: `perf/refit_cache_s` (torch's cache emptied first), `perf/refit_gather_s` (the
        policy's side: its state dict, each tensor's whole value and cast, pulled by the engine one at a time)
        and `perf/refit_engine_s` (the rest: the engine waking its weights and loading each tensor)."""
        t0 = time.monotonic()
        if self.engine is None:
            return 0.0
        if self._gpu:
            # A sleeping engine maps its weights back for refit: what training cached must go back
            # first (a 3B policy on one H200 ran out of memory there without this).
            torch.cuda.empty_cache()
        cache_s = time.monotonic() - t0
        gather = [0.0]
        self.engine.refit(_clocked(self.policy.full_state_dict(self.engine.dtype), gather))
        self.engine_version = self.policy_version
        total = time.monotonic() - t0
        self.refit_timings = {"perf/refit_cache_s": cache_s, "perf/refit_gather_s": gather[0],
                              "perf/refit_engine_s": total - cache_s - gather[0]}
        return total


def _clocked(items: Iterator, seconds: list[float]) -> Iterator:
    """`items` as they come, adding to seconds[0] the time spent making each (the producer's side of a stream)."""
    it = iter(items)
    while True:
        t = time.monotonic()
        try:
            item = next(it)
        except StopIteration:
            seconds[0] += time.monotonic() - t
            return
        seconds[0] += time.monotonic() - t
        yield item
