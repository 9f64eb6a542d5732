"""One optimizer step over packed micro-batches, shared by SFT and GRPO.

Every rank runs the same number of micro-batches (the count is agreed by all-reduce; a rank with
fewer samples runs zero-weighted dummy ones) so FSDP collectives line up. Losses are normalized
once by the global count of scored tokens (or sequences). Loss and grad norm are checked finite
before the optimizer steps; a non-finite step is skipped and counted.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from data.batch import Batch
from models.packing import (
    PackedMicrobatch, bins_fit, first_fit_decreasing, grouped_bins, image_groups, pack, plan_microbatches,
    prompt_groups, shared_row_tokens, unpack_per_sequence,
)
from models.parallel import local_tensors
from models.phases import phase_range
from models.policy import Policy, vision_plan


def all_reduce_sum(values: list[float], device) -> list[float]:
    """The sums over ranks; with one rank the values themselves (no trip through the device, which waits for it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def read_floats(values: list) -> list[float]:
    """Python numbers and 0-d tensors as floats, the tensors of each device read back in one go: each read waits
    for the device to run everything queued before it, and the device then idles until the host queues more."""
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    out = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values]
    for where in by_device.values():
        read = torch.stack([values[i].detach().reshape(()).double() for i in where]).tolist()
        for i, x in zip(where, read):
            out[i] = x
    return out


def all_reduce_max_int(value: int, device) -> int:
    """The largest over ranks; with one rank the value itself."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return int(value)
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def common_microbatches(batch: Batch, max_tokens: int, device, share_prompts: bool = False) -> list[list[int]]:
    """Micro-batches of this rank's samples, the same count on every rank.

    Each image's samples are kept in as few micro-batches as the count allows (the vision tower
    runs once per distinct image of a micro-batch); where that does not fit, token-balanced bins.
    With `share_prompts` a bin's size is the row `pack_shared` builds (each shared prompt once), and
    the planning lengths spread each prompt over its responses.
    """
    lengths = [t.numel() for t in batch["input_ids"].items] if len(batch) else []
    groups = image_groups(batch) if lengths else []
    fits = lambda bins: bins_fit(bins, lengths, max_tokens)  # noqa: E731
    plan = lengths
    if share_prompts and lengths:
        prefix_of, group_of, size_of = [0] * len(lengths), [0] * len(lengths), [1] * len(lengths)
        for g, (members, prefix) in enumerate(prompt_groups(batch)):
            for i in members:
                prefix_of[i], group_of[i], size_of[i] = prefix, g, len(members)
        plan = [n - prefix_of[i] + -(-prefix_of[i] // size_of[i]) for i, n in enumerate(lengths)]
        groups = group_of  # a prompt's samples kept together (text-only prompts too)
        fits = lambda bins: all(  # noqa: E731
            len(b) <= 1 or shared_row_tokens(b, lengths, prefix_of, group_of) <= max_tokens for b in bins)
    count = all_reduce_max_int(len(first_fit_decreasing(plan, max_tokens)) if lengths else 1, device)
    while True:
        bins = grouped_bins(plan, groups, count, max_tokens)
        if not fits(bins):
            bins = plan_microbatches(plan, max_tokens, count)
        ok = all_reduce_max_int(0 if fits(bins) else 1, device) == 0
        if ok:
            return bins
        count += 1


def dummy_microbatch() -> PackedMicrobatch:
    """Two text tokens, one scored: keeps a rank's collectives in step when it has nothing to train on."""
    ids = torch.zeros(1, 2, dtype=torch.long)
    pos = torch.arange(2).view(1, 1, 2).expand(4, 1, 2).contiguous()
    one = torch.ones(1, dtype=torch.long)
    return PackedMicrobatch(ids, pos, None, None, torch.tensor([0, 2], dtype=torch.int32),
                            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0 * one, [])


class PackedStep:
    """One step's sequences packed once, on the device, and kept in that shape for every pass.

    The micro-batch plan is made once (the same count on every rank); each micro-batch is packed
    and moved to the device once. Per-token fields (engine, old and reference logprobs, token
    weights, advantages) live beside each micro-batch in `fields[j][name]` as (K_j,) tensors in
    the row's target order, so old/ref logprob passes and every PPO epoch read them where the
    loss is computed, with no trip through the CPU. A bin with no samples (this rank has fewer
    sequences than another) is a zero-weighted dummy micro-batch that keeps collectives in step.
    """

    def __init__(self, batch: Batch, max_tokens: int, device, share_prompts: bool = False):
        self.batch = batch
        self.max_tokens = max_tokens
        with phase_range("pack"):
            self.bins = common_microbatches(batch, max_tokens, device, share_prompts)
            self.microbatches = [(pack(batch, b, share_prompts) if b else dummy_microbatch()).to(device)
                                 for b in self.bins]
        self.fields: list[dict[str, torch.Tensor]] = [{} for _ in self.microbatches]
        self.device = device

    def __len__(self) -> int:
        return len(self.batch)

    def __iter__(self):
        """(micro-batch, its fields) pairs, dummy micro-batches included."""
        return iter(zip(self.microbatches, self.fields))

    def set_per_token(self, name: str, values: list[torch.Tensor]) -> None:
        """A per-sample field of one value per scored token (e.g. engine logprobs), packed."""
        for mb, f in self:
            if mb.sample_indices:
                f[name] = torch.cat([values[i].reshape(-1) for i in mb.sample_indices]).to(
                    self.device, torch.float32, non_blocking=True)

    @functools.cached_property
    def scored(self) -> list[int]:
        """Each sample's scored tokens, in batch order, from the host's loss masks (the packer's rule: a token is
        scored where its mask is set, the first token never): no read of the device."""
        return [int(m[1:].bool().sum()) for m in self.batch["loss_mask"].items]

    def set_per_sequence(self, name: str, values: torch.Tensor) -> None:
        """A per-sample scalar (e.g. the advantage), broadcast to every scored token of its sequence. Made on the
        host and queued to the device (no blocking copy: the device's queue keeps running meanwhile)."""
        host = values.detach().to("cpu", torch.float32)
        for mb, f in self:
            if mb.sample_indices:
                per_token = host[mb.sample_indices].repeat_interleave(
                    torch.tensor([self.scored[i] for i in mb.sample_indices]))
                f[name] = per_token.to(self.device, non_blocking=True)

    def scored_counts(self) -> tuple[float, float]:
        """(scored tokens, sequences with any) of this rank's samples, from the host's loss masks."""
        per_sample = [self.scored[i] for mb in self.microbatches for i in mb.sample_indices]
        return float(sum(per_sample)), float(sum(n > 0 for n in per_sample))

    def per_sample(self, name: str) -> list[torch.Tensor]:
        """A packed field back as one CPU tensor per sample, in batch order (for reports and tests)."""
        out: list[torch.Tensor] = [torch.zeros(0)] * len(self.batch)
        for mb, f in self:
            if mb.sample_indices and name in f:
                for i, chunk in zip(mb.sample_indices, unpack_per_sequence(f[name].float().cpu(), mb.to("cpu"))):
                    out[i] = chunk
        return out

    def sequence_sums(self, name: str) -> torch.Tensor:
        """Per-sample sums of a packed per-token field, (N,) on the device."""
        out = torch.zeros(len(self.batch), device=self.device)
        for mb, f in self:
            if mb.sample_indices and name in f:
                index = torch.tensor(mb.sample_indices).to(self.device, non_blocking=True)
                out.index_add_(0, index[mb.target_seq], f[name].float())
        return out


def as_packed(batch: "Batch | PackedStep", max_tokens: int, device) -> PackedStep:
    return batch if isinstance(batch, PackedStep) else PackedStep(batch, max_tokens, device)


def pass_vision(policy: Policy, step: PackedStep):
    """The pass's vision tower calls (model.vision_once: `Policy.pass_vision`), the same count on every rank; a
    context yielding None where the tower runs per micro-batch."""
    if not policy.vision_once:
        return policy.pass_vision(step.microbatches, None)
    plan = vision_plan(policy, step.microbatches, step.max_tokens)
    if dist.is_initialized() and dist.get_world_size() > 1:
        plan += [[]] * (all_reduce_max_int(len(plan), step.device) - len(plan))
    return policy.pass_vision(step.microbatches, plan)


@torch.no_grad()
def packed_logprobs(policy: Policy, step: PackedStep, name: str, temperature: float = 1.0) -> None:
    """Scored-token logprobs of every micro-batch into the packed field `name`, on the device
    (old or reference logprobs); a collective across ranks."""
    with policy.gathered(), pass_vision(policy, step):
        for mb, f in step:
            lp, _ = policy.logprobs(mb, temperature=temperature)
            if mb.sample_indices:
                f[name] = lp.float()


@torch.no_grad()
def sequence_logprobs(policy: Policy, batch: "Batch | PackedStep", max_tokens: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Scored-token logprobs (and entropies) per sample, in batch order, on CPU; collective across ranks."""
    step = as_packed(batch, max_tokens, policy.device)
    with policy.gathered(), pass_vision(policy, step):
        for mb, f in step:
            lp, ent = policy.logprobs(mb, temperature=temperature, with_entropy=with_entropy)
            if mb.sample_indices:
                f["_logprobs"] = lp.float()
                if with_entropy:
                    f["_entropy"] = ent.float()
    return step.per_sample("_logprobs"), (step.per_sample("_entropy") if with_entropy else None)


LossFn = Callable[[torch.Tensor, PackedMicrobatch, dict], tuple[torch.Tensor, dict[str, float]]]


class _Hold:
    """FSDP2: skip (hold=True) or do the gradient reduce and the reshard after each backward, set on each of the
    policy's FSDP units (found once, not by a walk over every submodule), and only when it changes: twice a step,
    however many micro-batches. A `kept` unit's reshard is left to its owner (`_kept_tower`)."""

    def __init__(self, policy: Policy, kept: torch.nn.Module | None = None):
        self.units, self.kept, self.held = policy.fsdp_units, kept, None

    def __call__(self, hold: bool) -> None:
        if hold != self.held:
            for unit in self.units:
                unit.set_requires_gradient_sync(not hold, recurse=False)
                if unit is not self.kept:
                    unit.set_reshard_after_backward(not hold, recurse=False)
            self.held = hold


def _kept_tower(policy: Policy, vision) -> torch.nn.Module | None:
    """With one data-parallel rank, the FSDP unit of a tower that the pass's `vision` (model.vision_once) trains:
    kept gathered from its features' forward before the micro-batches to its own backward after them. A unit
    reshards at the end of every backward it takes part in or is gathered for, so the last micro-batch's backward
    would free the tower's compute copy and the tower's backward would make it again (a cast and a copy of each
    of its parameters). None where the tower runs per micro-batch, is frozen, or reshards after its forward
    anyway (more than one rank)."""
    if vision is None or not vision.trains or policy.dims.dp != 1:
        return None
    tower = policy.adapter.vision_tower(policy.model)
    return tower if hasattr(tower, "set_reshard_after_backward") else None


def optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, batch: "Batch | PackedStep", loss_fn: LossFn, *,
                   max_tokens: int, grad_clip: float, temperature: float = 1.0, denominators: dict,
                   unsharded_accumulation: bool = False) -> dict:
    """Forward/backward every micro-batch, clip, check finiteness, step. Returns local metric sums.

    `loss_fn(logprobs, mb, denominators)` returns a loss already normalized by the global
    denominators, and a dict of metric sums (floats or 0-d tensors; read with the loss and the gradient norm
    in one go, after the clip, so no micro-batch waits on the host); it is scaled by the data-parallel size
    because FSDP averages gradients. A PackedStep's fields reach it as `mb.fields`.

    `unsharded_accumulation` (one data-parallel rank only; `optim.unsharded_accumulation`): every
    FSDP unit keeps its low-precision compute copy and its unsharded fp32 gradient from one
    micro-batch to the next, so FSDP's copy-out and cast of the parameters, and its reduce copy of
    the gradients, run once per step instead of once per micro-batch.

    With `model.vision_once` the vision tower runs over the step's images before the micro-batches, per chunk,
    and a trained tower's backward once after them, before the clip (`Policy.pass_vision`).
    """
    device = policy.device
    dp = policy.dims.dp
    step = as_packed(batch, max_tokens, device)
    optimizer.zero_grad(set_to_none=True)
    totals: list[torch.Tensor] = []
    sums: dict[str, list] = {}
    hold = unsharded_accumulation and dp == 1 and hasattr(policy.model, "set_requires_gradient_sync")
    last = len(step.microbatches) - 1
    with pass_vision(policy, step) as vision:
        tower = _kept_tower(policy, vision)
        held = _Hold(policy, kept=tower)
        if tower is not None:  # gathered for its features' forward: kept so through every micro-batch's backward
            tower.set_reshard_after_backward(False, recurse=False)
        try:
            for i, (mb, fields) in enumerate(step):
                if hold:
                    held(i < last)
                mb.fields = fields
                if mb.sample_indices:
                    lp, ent = policy.logprobs(mb, temperature=temperature, with_entropy=True)
                    with phase_range("loss"):
                        loss, m = loss_fn(lp, mb, denominators)
                        sums.setdefault("loss/entropy_sum", []).append(ent.detach().float().sum())
                    if policy.router_aux is not None:  # MoE: each micro-batch's share of the step's scored tokens
                        aux = policy.router_aux * (mb.num_targets / denominators["tokens"])
                        loss = loss + policy.router_aux_coef * aux
                        sums.setdefault("loss/router_aux_sum", []).append(aux.detach())
                else:
                    lp, _ = policy.logprobs(mb, temperature=temperature)
                    loss, m = lp.sum() * 0.0, {}
                with phase_range("backward"):
                    (loss * dp).backward()
                    policy.after_backward()
                totals.append(loss.detach().float().reshape(()))
                for k, v in m.items():
                    sums.setdefault(k, []).append(v)
        finally:
            if hold:
                held(False)
            if tower is not None:  # its own backward reduces its gradients and reshards it
                tower.set_reshard_after_backward(True, recurse=False)
        if vision is not None:  # a trained tower's backward, once, from its features' summed gradients
            with phase_range("vision tower backward"):
                vision.backward()
                policy.after_backward()
    policy.reshard()  # the parameters the optimizer holds back in the model, with the step's gradients
    with phase_range("clip and optimizer step"):
        params = [p for p in policy.model.parameters() if p.grad is not None]
        grad_norm = clip_gradients(params, grad_clip if grad_clip > 0 else float("inf"))
        # the loss, the norm and the metric sums in one read back, queued behind the clip's kernels
        keys = list(sums)
        loss_total, grad_norm, *values = read_floats(
            [torch.stack(totals).sum() if totals else 0.0, grad_norm, *(sum(sums[k]) for k in keys)])
        sums = dict(zip(keys, values))
        (loss_global,) = all_reduce_sum([loss_total], device)
        finite = math.isfinite(loss_global) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"loss/total": loss_global, "loss/grad_norm": grad_norm, "loss/skipped_nonfinite": 0.0 if finite else 1.0,
            **sums}


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_`: the 2-norm over every gradient, each gradient scaled in place by
    min(1, max_norm / (norm + 1e-6)); returns the norm as a plain tensor. Where every gradient is on one device,
    the same computation runs on their local tensors, without DTensor's dispatch of the lists through each op."""
    grads = local_tensors([p.grad for p in params]) if params else None
    if grads is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._foreach_mul_(same, scale.to(same[0].device))
    return norm


class AdamW(torch.optim.AdamW):
    """torch's AdamW, whose update runs on the local tensors of parameters that live on one device (one rank, no
    tensor parallelism: their local tensor is the whole parameter): the same kernels, fused on CUDA, and bitwise
    the same numbers, without DTensor's dispatch of the parameters, gradients and moments through each op. The
    state stays keyed by the parameters and holds DTensors, so checkpoints see torch's AdamW."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        lists = [each for each in lists if isinstance(each, list)]
        local = local_tensors([t for each in lists for t in each])
        if local is not None:
            for each in lists:
                each[:], local = local[:len(each)], local[len(each):]
        return has_complex


def lr_at(step: int, cfg_optim, max_steps: int) -> float:
    """Linear warmup to `lr`, then constant or cosine decay to `min_lr_ratio · lr` (step counts from 1)."""
    base = cfg_optim.lr
    if cfg_optim.warmup_steps and step <= cfg_optim.warmup_steps:
        return base * step / cfg_optim.warmup_steps
    if cfg_optim.schedule == "constant":
        return base
    span = max(max_steps - cfg_optim.warmup_steps, 1)
    frac = min(max(step - cfg_optim.warmup_steps, 0) / span, 1.0)
    floor = cfg_optim.min_lr_ratio
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_optimizer(policy: Policy, cfg_optim) -> torch.optim.Optimizer:
    """AdamW over the parameters that train: all of them, or only the adapters with LoRA (frozen
    weights get no optimizer state); its state made now with `optim.allocate_state_at_start`."""
    kwargs = dict(lr=cfg_optim.lr, betas=(cfg_optim.beta1, cfg_optim.beta2), eps=cfg_optim.eps,
                  weight_decay=cfg_optim.weight_decay)
    if policy.device.type == "cuda":
        kwargs["fused"] = True
    optimizer = AdamW([p for p in policy.model.parameters() if p.requires_grad], **kwargs)
    if getattr(cfg_optim, "allocate_state_at_start", False):
        allocate_state(optimizer)
    return optimizer


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state now, as its first step would, and leave it as that step finds it.

    One step with zero gradients at a learning rate of 0 makes every moment (zeros) in the optimizer's
    own layout, dtype and placement (sharded like its parameter) and moves no parameter (AdamW's decay
    and update both scale with the rate); the step counts go back to 0, so the first real step is
    step 1 as without. A checkpoint loaded later overwrites all of it. On CUDA the zero gradients'
    blocks go back to the device."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
