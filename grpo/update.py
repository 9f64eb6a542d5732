"""One optimizer step over packed micro-batches, shared by SFT and GRPO.

Every rank runs the same number of micro-batches (the count is agreed by all-reduce; a rank with
fewer samples runs zero-weighted dummy ones) so FSDP collectives line up. Losses are normalized
once by the global count of scored tokens (or sequences). Loss and grad norm are checked finite
before the optimizer steps; a non-finite step is skipped and counted.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from data.batch import Batch
from models.packing import (
    PackedMicrobatch, bins_fit, first_fit_decreasing, grouped_bins, image_groups, pack, plan_microbatches,
    unpack_per_sequence,
)
from models.policy import Policy


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_max_int(value: int, device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def common_microbatches(batch: Batch, max_tokens: int, device) -> list[list[int]]:
    """Micro-batches of this rank's samples, the same count on every rank.

    Each image's samples are kept in as few micro-batches as the count allows (the vision tower
    runs once per distinct image of a micro-batch); where that does not fit, token-balanced bins.
    """
    lengths = [t.numel() for t in batch["input_ids"].items] if len(batch) else []
    groups = image_groups(batch) if lengths else []
    count = all_reduce_max_int(len(first_fit_decreasing(lengths, max_tokens)) if lengths else 1, device)
    while True:
        bins = grouped_bins(lengths, groups, count, max_tokens)
        if not bins_fit(bins, lengths, max_tokens):
            bins = plan_microbatches(lengths, max_tokens, count)
        ok = all_reduce_max_int(0 if bins_fit(bins, lengths, max_tokens) else 1, device) == 0
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


def per_target(batch: Batch, mb: PackedMicrobatch, name: str) -> torch.Tensor:
    """A per-sample field aligned to scored tokens, concatenated in the micro-batch's target order."""
    return torch.cat([batch[name][i].reshape(-1) for i in mb.sample_indices])


def padded(values: torch.Tensor, mb: PackedMicrobatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(K,) per-target values → (S, T) per-sequence rows and their mask."""
    s = max(len(mb.sample_indices), 1)
    counts = torch.bincount(mb.target_seq.to(values.device), minlength=s)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(values.shape[0], device=values.device) - starts[mb.target_seq.to(values.device)]
    out = values.new_zeros(s, width)
    mask = torch.zeros(s, width, dtype=torch.bool, device=values.device)
    out = out.index_put((mb.target_seq.to(values.device), col), values)
    mask[mb.target_seq.to(values.device), col] = True
    return out, mask


@torch.no_grad()
def sequence_logprobs(policy: Policy, batch: Batch, max_tokens: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Scored-token logprobs (and entropies) per sample, in batch order; collective across ranks."""
    out: list[torch.Tensor | None] = [None] * len(batch)
    ents: list[torch.Tensor | None] = [None] * len(batch)
    for bin_ in common_microbatches(batch, max_tokens, policy.device):
        mb = pack(batch, bin_) if bin_ else dummy_microbatch()
        lp, ent = policy.logprobs(mb, temperature=temperature, with_entropy=with_entropy)
        for i, chunk in zip(mb.sample_indices, unpack_per_sequence(lp.float().cpu(), mb)):
            out[i] = chunk
        if with_entropy:
            for i, chunk in zip(mb.sample_indices, unpack_per_sequence(ent.float().cpu(), mb)):
                ents[i] = chunk
    return out, (ents if with_entropy else None)


LossFn = Callable[[torch.Tensor, PackedMicrobatch, dict], tuple[torch.Tensor, dict[str, float]]]


def optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn, *,
                   max_tokens: int, grad_clip: float, temperature: float = 1.0, denominators: dict) -> dict:
    """Forward/backward every micro-batch, clip, check finiteness, step. Returns local metric sums.

    `loss_fn(logprobs, mb, denominators)` returns a loss already normalized by the global
    denominators; it is scaled by the data-parallel size because FSDP averages gradients.
    """
    device = policy.device
    dp = policy.dims.dp
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    sums: dict[str, float] = {}
    for bin_ in common_microbatches(batch, max_tokens, device):
        if bin_:
            mb = pack(batch, bin_)
            lp, ent = policy.logprobs(mb, temperature=temperature, with_entropy=True)
            loss, m = loss_fn(lp, mb, denominators)
            sums["loss/entropy_sum"] = sums.get("loss/entropy_sum", 0.0) + float(ent.sum())
        else:
            lp, _ = policy.logprobs(dummy_microbatch(), temperature=temperature)
            loss, m = lp.sum() * 0.0, {}
        (loss * dp).backward()
        loss_total += float(loss.detach())
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    params = [p for p in policy.model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    (loss_global,) = all_reduce_sum([loss_total], device)
    finite = math.isfinite(loss_global) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss/total": loss_global, "loss/grad_norm": grad_norm, "loss/skipped_nonfinite": 0.0 if finite else 1.0,
            **sums}


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
    kwargs = dict(lr=cfg_optim.lr, betas=(cfg_optim.beta1, cfg_optim.beta2), eps=cfg_optim.eps,
                  weight_decay=cfg_optim.weight_decay)
    if policy.device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(policy.model.parameters(), **kwargs)
