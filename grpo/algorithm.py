"""The math of GRPO and its relatives, as pure torch functions.

Nothing here knows about models, devices or ranks. Per-token tensors are shaped (B, T): B
sequences, T token positions, with a `mask` of the same shape marking response tokens (bool, or
float where nonzero means valid). The trainer passes the packed form instead: (K,) tensors of a
micro-batch's scored tokens in row order with `segments` (K,), each token's sequence index in
0..S-1 (`num_segments` = S); every function that reduces per sequence takes both forms and gives
the same numbers. Positions outside the mask may hold anything, even NaN or inf:
the reductions and `policy_loss` select valid entries (masked_fill) instead of multiplying by
the mask, because NaN * 0 is NaN, and `policy_loss` keeps such values out of the gradient too.
Element-wise functions (`kl_penalty`, `tis_weights`) compute every position as given.

Functions that normalize by a count take the denominator as an argument (`global_tokens`,
`global_seqs`) so a caller that splits a batch over ranks and micro-batches can pass the count
for the whole step, all-reduced once; the local count is only the default. `valid_counts` gives
the numbers those arguments expect, counted the same way the defaults count them.

Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before they are exponentiated: a
token whose logprob moved by more than 20 nats is already an outlier, and exp(88) overflows
float32.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0
STD_TOLERANCE = 1e-6

AdvEstimator = Literal["grpo", "grpo_no_std", "rloo"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

_ADV_ESTIMATORS = ("grpo", "grpo_no_std", "rloo")
_KL_ESTIMATORS = ("k1", "k2", "k3")
_LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

Count = float | int | torch.Tensor


# --------------------------------------------------------------------------------------------
# input checks


def _check_choice(where: str, name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{where}: {name}={value!r} is not one of {', '.join(valid)}")


def _check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{where}: shapes must match, got {listed}")


def _check_2d(where: str, name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{where}: {name} must be (B, T), got shape {tuple(x.shape)}")


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_tokens(where: str, name: str, x: torch.Tensor, segments: torch.Tensor | None) -> None:
    """(B, T) without segments, or (K,) with (K,) segments (the packed form)."""
    if segments is None:
        _check_2d(where, name, x)
    elif x.dim() != 1 or segments.shape != x.shape:
        raise ValueError(f"{where}: packed {name} must be (K,) with segments (K,), got {tuple(x.shape)} and "
                         f"{tuple(segments.shape)}")


def _num_segments(segments: torch.Tensor, num_segments: int | None) -> int:
    if num_segments is not None:
        return num_segments
    return int(segments.max()) + 1 if segments.numel() else 0


def _per_sequence_sum(values: torch.Tensor, segments: torch.Tensor | None, num_segments: int | None) -> torch.Tensor:
    """Row sums of (B, T) values, or per-segment sums of packed (K,) values."""
    if segments is None:
        return values.sum(dim=1)
    out = values.new_zeros(_num_segments(segments, num_segments))
    return out.index_add(0, segments, values)


def _group_view(where: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) rewards → (N/G, G) float64 view of consecutive groups, after checking the input."""
    if rewards.dim() != 1:
        raise ValueError(f"{where}: rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{where}: group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{where}: {rewards.numel()} rewards do not split into groups of {group_size}"
        )
    values = rewards.detach().to(torch.float64)
    if not torch.isfinite(values).all():
        bad = torch.nonzero(~torch.isfinite(values)).flatten().tolist()
        raise ValueError(f"{where}: rewards must be finite; non-finite at indices {bad[:8]}")
    return values.view(-1, group_size)


def _denominator(where: str, name: str, given: Count | None, local: torch.Tensor) -> torch.Tensor:
    """The count to divide by: `given` if set, else `local`; at least 1.

    A zero count only happens when the numerator is a sum over nothing (0), so dividing by 1
    instead keeps the loss 0 and still attached to the graph: every rank must run backward.
    """
    if given is None:
        count = local.to(torch.float32)
    elif isinstance(given, (int, float)) and not isinstance(given, bool):
        # checked on the host and filled on the device: no copy from the host, no read back per micro-batch
        if not math.isfinite(given) or given < 0:
            raise ValueError(f"{where}: {name} must be a finite count >= 0, got {given!r}")
        return torch.full((), max(float(given), 1.0), dtype=torch.float32, device=local.device)
    else:
        count = torch.as_tensor(given, dtype=torch.float32, device=local.device)
        if count.numel() != 1 or not torch.isfinite(count) or count < 0:
            raise ValueError(f"{where}: {name} must be a finite count >= 0, got {given!r}")
        count = count.reshape(())
    return count.clamp_min(1.0)


# --------------------------------------------------------------------------------------------
# reductions


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over entries where `mask` is set (over all of them, or along `dim`).

    `x` and `mask` share a shape. A reduction over no valid entries gives 0, not NaN.
    """
    _check_same_shape("masked_mean", x=x, mask=mask)
    valid = _as_bool(mask)
    total = x.masked_fill(~valid, 0)
    if dim is None:
        return total.sum() / valid.sum().clamp_min(1)
    return total.sum(dim) / valid.sum(dim).clamp_min(1)


def valid_counts(mask: torch.Tensor, segments: torch.Tensor | None = None,
                 num_segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, sequences with at least one valid token) of a (B, T) mask (or a packed (K,)
    mask with its segments), as float32 scalars: what `global_tokens` / `global_seqs` expect once
    summed over ranks and micro-batches.
    """
    _check_tokens("valid_counts", "mask", mask, segments)
    valid = _as_bool(mask)
    tokens = valid.sum().to(torch.float32)
    seqs = (_per_sequence_sum(valid.float(), segments, num_segments) > 0).sum().to(torch.float32)
    return tokens, seqs


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    *,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss (or a packed (K,) one with its `segments`) to a scalar.

    - ``token-mean``: sum of valid token losses / `global_tokens` (default: local valid tokens).
    - ``seq-mean-token-sum``: sum over sequences of their token-loss sums / `global_seqs`.
    - ``seq-mean-token-mean``: sum over sequences of their token-loss means / `global_seqs`.

    `global_seqs` defaults to the local number of sequences with at least one valid token; such
    empty sequences contribute 0 in every mode. Passing the step-wide counts makes the sum over
    ranks and micro-batches of these losses equal the loss of the whole step. A whole sequence
    must sit in one call for ``seq-mean-token-mean``, since its mean needs all its tokens.
    """
    where = "aggregate_loss"
    _check_choice(where, "mode", mode, _LOSS_AGGS)
    _check_tokens(where, "per_token", per_token, segments)
    _check_same_shape(where, per_token=per_token, mask=mask)
    valid = _as_bool(mask)
    values = per_token.masked_fill(~valid, 0.0)
    tokens, seqs = valid_counts(valid, segments, num_segments)
    if mode == "token-mean":
        return values.sum() / _denominator(where, "global_tokens", global_tokens, tokens)
    seq_sums = _per_sequence_sum(values, segments, num_segments)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / _per_sequence_sum(valid.to(values.dtype), segments, num_segments).clamp_min(1)
    return seq_sums.sum() / _denominator(where, "global_seqs", global_seqs, seqs)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the softmax over the last dim: (..., V) → (...), in float32.

    H = -sum_v p_v log p_v with log p from log_softmax, which subtracts the max logit first, so
    large logits lose no precision. Logits of -inf (masked vocabulary entries) have p = 0 and are
    left out instead of giving 0 * -inf = NaN. Meant for metrics; for a large vocabulary call it
    on chunks of tokens.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    plogp = torch.where(torch.isneginf(logp), torch.zeros((), device=logp.device), logp.exp() * logp)
    return -plogp.sum(dim=-1)


# --------------------------------------------------------------------------------------------
# advantages and rewards


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: AdvEstimator = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per response: (N,) rewards → (N,) advantages.

    Groups are consecutive blocks of `group_size` responses to the same prompt.

    - ``grpo``: (r - mean) / (std + eps), std the unbiased sample std (torch.std's default,
      as veRL and EasyR1 use).
    - ``grpo_no_std``: r - mean (Dr. GRPO: no per-group scaling).
    - ``rloo``: r_i - mean of the other G-1 rewards = G/(G-1) * (r_i - mean).

    A group whose rewards are all equal carries no signal and gets exactly 0 (not the rounding
    residue of r - mean divided by eps). A group of one response has no baseline and gets 0.
    Computed in float64; returned in the rewards' float dtype (float32 for integer rewards).
    """
    where = "compute_advantages"
    _check_choice(where, "estimator", estimator, _ADV_ESTIMATORS)
    groups = _group_view(where, rewards, group_size)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if group_size == 1:
        return torch.zeros(rewards.shape, dtype=out_dtype, device=rewards.device)
    mean = groups.mean(dim=1, keepdim=True)
    centered = groups - mean
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    centered = torch.where(flat, torch.zeros_like(centered), centered)
    if estimator == "grpo":
        adv = centered / (groups.std(dim=1, keepdim=True) + eps)
    elif estimator == "grpo_no_std":
        adv = centered
    else:
        adv = centered * (group_size / (group_size - 1))
    return adv.reshape(-1).to(out_dtype)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups carry a learning signal: (N,) rewards → bool (N / group_size,).

    A group is kept when its rewards are not all equal: population std > 1e-6 (a tolerance so
    rewards equal up to rounding count as equal). A group of one response is never kept.
    """
    groups = _group_view("dynamic_sampling_keep", rewards, group_size)
    return groups.std(dim=1, correction=0) > STD_TOLERANCE


def overlong_penalty(
    lengths: torch.Tensor,
    max_new_tokens: int,
    buffer: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: (N,) lengths → (N,) float32.

    0 up to `max_new_tokens - buffer` tokens, then a straight line down to `-penalty` at
    `max_new_tokens`, and `-penalty` beyond it. `buffer <= 0` turns it off (all zeros).
    """
    where = "overlong_penalty"
    if lengths.dim() != 1:
        raise ValueError(f"{where}: lengths must be 1-D (N,), got shape {tuple(lengths.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {max_new_tokens}")
    if buffer > max_new_tokens:
        raise ValueError(f"{where}: buffer={buffer} exceeds max_new_tokens={max_new_tokens}")
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    over = (lengths - (max_new_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer


# --------------------------------------------------------------------------------------------
# KL and importance weights


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi; same shape as the inputs.

    With d = logp - ref_logp = log(pi / ref) at the sampled token:

    - ``k1`` = d: unbiased, high variance, can be negative.
    - ``k2`` = d^2 / 2: biased, low variance, >= 0.
    - ``k3`` = exp(-d) + d - 1 = ref/pi - 1 - log(ref/pi): unbiased, >= 0 (veRL's low_var_kl).

    For k3, d is clamped to [-20, 20] first (the gradient is zero beyond), so the exp cannot
    overflow; the result stays >= 0. All three are 0 where logp == ref_logp.
    """
    where = "kl_penalty"
    _check_choice(where, "estimator", estimator, _KL_ESTIMATORS)
    _check_same_shape(where, logp=logp, ref_logp=ref_logp)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    back = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(back) - back - 1.0


def tis_weights(
    old_logp_train: torch.Tensor, engine_logp: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling weights min(exp(old_logp_train - engine_logp), cap).

    They correct for tokens sampled by the engine but scored by the trainer. Detached, same
    shape as the inputs; `cap <= 0` turns the correction off (all ones).
    """
    _check_same_shape("tis_weights", old_logp_train=old_logp_train, engine_logp=engine_logp)
    old = old_logp_train.detach().float()
    if cap <= 0:
        return torch.ones_like(old)
    log_ratio = (old - engine_logp.detach().float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap)


# --------------------------------------------------------------------------------------------
# the policy loss


def _expand_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == 1 and like.dim() == 2 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    raise ValueError(
        f"policy_loss: advantages must be (B,) or (B, T) for logp {tuple(like.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
    loss_agg: LossAgg = "token-mean",
    tis_weights: torch.Tensor | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss with asymmetric clipping, optional dual clip and TIS weights.

    Shapes: logp, old_logp, mask, tis_weights (B, T); advantages (B,) or (B, T). Packed: all of
    them (K,) with `segments` (K,), the sequence of each token (advantages per token too).
    With r = exp(logp - old_logp) (log-ratio clamped to [-20, 20]) and A the advantage:

        per_token = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        if dual_clip > 1 and A < 0:  per_token = min(per_token, -A dual_clip)
        per_token *= tis_weights                                    (when given)

    then `aggregate_loss(per_token, mask, loss_agg, ...)`. Gradients reach `logp` only:
    old_logp, advantages and tis_weights are detached.

    Metrics (detached scalars, masked means over the local valid tokens):
    ``clip_fraction`` (the clipped term was the larger one; split into ``clip_fraction_low``
    for r < 1 - clip_low and ``clip_fraction_high`` for r > 1 + clip_high),
    ``dual_clip_fraction`` (the dual-clip bound was taken), ``approx_kl`` (k3 estimate of
    KL(pi_old || pi) from the sampled tokens: mean of r - 1 - log r), ``ratio_mean``,
    ``ratio_max``, ``ratio_min`` (0 when there are no valid tokens) and ``tokens`` (the local
    valid-token count, for weighting these means across ranks).
    """
    where = "policy_loss"
    _check_tokens(where, "logp", logp, segments)
    _check_same_shape(where, logp=logp, old_logp=old_logp, mask=mask)
    if tis_weights is not None:
        _check_same_shape(where, logp=logp, tis_weights=tis_weights)
    if dual_clip and dual_clip <= 1.0:
        raise ValueError(f"{where}: dual_clip must be 0 (off) or > 1, got {dual_clip}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"{where}: clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    valid = _as_bool(mask)
    # Zero both factors outside the mask: a NaN there would reach logp.grad as 0 * NaN.
    adv = _expand_advantages(advantages.detach().float(), logp).masked_fill(~valid, 0.0)
    log_ratio = (logp.float() - old_logp.detach().float()).masked_fill(~valid, 0.0)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(valid)
    if dual_clip:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach().float()
    loss = aggregate_loss(per_token, valid, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          segments=segments, num_segments=num_segments)
    clip_active = clipped > unclipped
    metrics = _policy_metrics(
        ratio.detach(), log_ratio.detach(), clip_active, dual_active, valid, clip_low, clip_high
    )
    return loss, metrics


def _policy_metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor,
    valid: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor]:
    """The detached diagnostics of `policy_loss`; see its docstring."""
    # r > 0, so filling invalid entries with 0 leaves the max alone and gives 0 when none are
    # valid; the min is filled with +inf and mapped back to 0, without a host sync either way.
    ratio_min = torch.where(valid, ratio, torch.inf).amin()
    return {
        "clip_fraction": masked_mean(clip_active.float(), valid),
        "clip_fraction_low": masked_mean((clip_active & (ratio < 1.0 - clip_low)).float(), valid),
        "clip_fraction_high": masked_mean((clip_active & (ratio > 1.0 + clip_high)).float(), valid),
        "dual_clip_fraction": masked_mean(dual_active.float(), valid),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, valid),
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_max": torch.where(valid, ratio, 0.0).amax(),
        "ratio_min": torch.where(torch.isinf(ratio_min), 0.0, ratio_min),
        "tokens": valid.sum().to(torch.float32),
    }


# --------------------------------------------------------------------------------------------
# engine / trainer mismatch


@torch.no_grad()
def mismatch_metrics(
    engine_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor,
    segments: torch.Tensor | None = None, num_segments: int | None = None,
) -> dict[str, torch.Tensor]:
    """How far the engine's logprobs of the sampled tokens are from the trainer's.

    Inputs (B, T), or packed (K,) with `segments` (then B = `num_segments`). With d = train_logp - engine_logp and e = exp(|d|) (|d| clamped to 20):

    - ``token_mult_prob_error``: local masked mean of e; ``token_mult_prob_error_sum`` and
      ``token_count`` let the caller all-reduce both and divide once for the global mean.
    - ``seq_max_mult_prob_error`` / ``seq_mean_mult_prob_error``: (B,) per-sequence max and
      mean of e; 1.0 (the value of a perfect match) for sequences with no valid tokens.
    - ``gen_kl``: k3 estimate of KL(P_engine || P_train) from the engine's samples, mean of
      exp(d) - d - 1 (>= 0); ``gen_kl_k1``: mean of -d = engine_logp - train_logp (unbiased
      but can be negative). Each comes with a ``*_sum`` for global reduction.

    Scalars are float32 tensors; nothing here carries gradients.
    """
    where = "mismatch_metrics"
    _check_tokens(where, "engine_logp", engine_logp, segments)
    _check_same_shape(where, engine_logp=engine_logp, train_logp=train_logp, mask=mask)
    valid = _as_bool(mask)
    delta = (train_logp.float() - engine_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    delta = torch.where(valid, delta, torch.zeros((), device=delta.device))
    mult = torch.exp(delta.abs())  # exactly 1 at invalid positions
    k3 = torch.exp(delta) - delta - 1.0  # exactly 0 at invalid positions
    count = valid.sum().to(torch.float32)
    sums = {"mult": mult.masked_fill(~valid, 0.0).sum(), "k3": k3.sum(), "k1": (-delta).sum()}
    seq_valid = _per_sequence_sum(valid.float(), segments, num_segments)
    has_tokens = seq_valid > 0
    seq_sum = _per_sequence_sum(mult.masked_fill(~valid, 0.0), segments, num_segments)
    if segments is None:
        seq_max = mult.amax(dim=1)
    else:
        seq_max = mult.new_ones(seq_valid.shape[0]).scatter_reduce(0, segments, mult, "amax")
    return {
        "token_mult_prob_error": sums["mult"] / count.clamp_min(1.0),
        "token_mult_prob_error_sum": sums["mult"],
        "token_count": count,
        "seq_max_mult_prob_error": seq_max,
        "seq_mean_mult_prob_error": torch.where(has_tokens, seq_sum / seq_valid.clamp_min(1), torch.ones_like(seq_sum)),
        "gen_kl": sums["k3"] / count.clamp_min(1.0),
        "gen_kl_sum": sums["k3"],
        "gen_kl_k1": sums["k1"] / count.clamp_min(1.0),
        "gen_kl_k1_sum": sums["k1"],
    }


def mismatch_sequence_mask(per_seq_max: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which sequences to keep: (B,) per-sequence max exp|d| → bool (B,), True = keep.

    A sequence is dropped when its max exceeds `threshold`; `threshold <= 0` keeps all.
    """
    if per_seq_max.dim() != 1:
        shape = tuple(per_seq_max.shape)
        raise ValueError(f"mismatch_sequence_mask: per_seq_max must be 1-D (B,), got shape {shape}")
    if threshold <= 0:
        return torch.ones_like(per_seq_max, dtype=torch.bool)
    return per_seq_max <= threshold


# --------------------------------------------------------------------------------------------
# objectives beyond PPO-clip: GSPO, CISPO, SAPO

PolicyLossName = Literal["ppo", "gspo", "cispo", "sapo"]
_POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo")


def _per_sequence_mean(values: torch.Tensor, valid: torch.Tensor, segments: torch.Tensor | None,
                       num_segments: int | None) -> torch.Tensor:
    """(S,) mean of `values` over each sequence's valid tokens; 0 for a sequence with none."""
    total = _per_sequence_sum(values.masked_fill(~valid, 0.0), segments, num_segments)
    return total / _per_sequence_sum(valid.to(values.dtype), segments, num_segments).clamp_min(1)


def _per_token(per_seq: torch.Tensor, like: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """A (S,) per-sequence value spread over that sequence's tokens, in `like`'s form."""
    return per_seq[segments] if segments is not None else per_seq.unsqueeze(-1).expand_as(like)


def _check_objective_inputs(where: str, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                            weights: torch.Tensor | None, segments: torch.Tensor | None) -> None:
    _check_tokens(where, "logp", logp, segments)
    _check_same_shape(where, logp=logp, old_logp=old_logp, mask=mask)
    if weights is not None:
        _check_same_shape(where, logp=logp, weights=weights)


def _clip_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, clip_low: torch.Tensor, clip_high: torch.Tensor,
                  valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics `policy_loss` reports, for an objective whose clipped tokens are `clip_low | clip_high`
    (bool, per token); ratio and log_ratio are the per-token r = pi / pi_old and log r."""
    clip_active = clip_low | clip_high
    ratio_min = torch.where(valid, ratio, torch.inf).amin()
    return {
        "clip_fraction": masked_mean(clip_active.float(), valid),
        "clip_fraction_low": masked_mean(clip_low.float(), valid),
        "clip_fraction_high": masked_mean(clip_high.float(), valid),
        "dual_clip_fraction": torch.zeros((), device=ratio.device),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, valid),
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_max": torch.where(valid, ratio, 0.0).amax(),
        "ratio_min": torch.where(torch.isinf(ratio_min), 0.0, ratio_min),
        "tokens": valid.sum().to(torch.float32),
    }


def _token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log r, r) per token, 0 and 1 outside the mask, log r clamped to [-20, 20]; the gradient reaches
    `logp` at valid positions only (masked_fill, so a NaN in a masked slot stays out of it)."""
    log_ratio = (logp.float() - old_logp.detach().float()).masked_fill(~valid, 0.0)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg: LossAgg = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    The ratio is the sequence's, normalised by its length: s_i = exp(mean_t (logp - old_logp)) over
    the valid tokens of sequence i (the mean clamped to [-20, 20]), and every token of i carries

        per_token = max(-A s_i, -A clip(s_i, 1 - clip_low, 1 + clip_high))

    (times `weights` when given), then `aggregate_loss(per_token, mask, loss_agg, ...)`. The gradient
    flows through s_i, so a token's gradient is s_i / |y_i| times its own score function; with
    ``seq-mean-token-mean`` (the paper's normalisation) this is the paper's objective exactly, and the
    sum over a sequence's tokens of any aggregation equals its |y_i| copies of the sequence term.
    Advantages must be constant within a sequence (GRPO's are). The clip range is the paper's
    (3e-4, 4e-4): a length-normalised ratio moves about 1000 times less than a token's.

    Shapes and the packed form as in `policy_loss`; a whole sequence must sit in one call. Metrics as
    `policy_loss`'s (ratios per token; a token counts as clipped when its sequence is), plus
    ``seq_clip_fraction`` (of sequences with a valid token) and ``seq_ratio_mean``.
    """
    where = "gspo_loss"
    _check_objective_inputs(where, logp, old_logp, mask, weights, segments)
    valid = _as_bool(mask)
    adv = _expand_advantages(advantages.detach().float(), logp).masked_fill(~valid, 0.0)
    log_ratio, ratio = _token_ratio(logp, old_logp, valid)
    seq_log_ratio = _per_sequence_mean(log_ratio, valid, segments, num_segments)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_ratio = _per_token(torch.exp(seq_log_ratio), logp, segments)
    unclipped = -adv * seq_ratio
    clipped = -adv * seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach().float()
    loss = aggregate_loss(per_token, valid, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          segments=segments, num_segments=num_segments)
    active = (clipped > unclipped).detach() & valid
    s = seq_ratio.detach()
    metrics = _clip_metrics(ratio.detach(), log_ratio.detach(), active & (s < 1.0 - clip_low),
                            active & (s > 1.0 + clip_high), valid)
    has_tokens = _per_sequence_sum(valid.float(), segments, num_segments) > 0
    seq_clipped = _per_sequence_sum(active.float(), segments, num_segments) > 0
    seqs = has_tokens.sum().clamp_min(1)
    metrics["seq_clip_fraction"] = seq_clipped.sum() / seqs
    metrics["seq_ratio_mean"] = torch.where(has_tokens, torch.exp(seq_log_ratio.detach()), 0.0).sum() / seqs
    return loss, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    loss_agg: LossAgg = "token-mean",
    weights: torch.Tensor | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1 technical report, Chen et al. 2025, arXiv:2506.13585, eq. 4-5).

    With r = exp(logp - old_logp) per token (log-ratio clamped to [-20, 20]):

        per_token = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp

    (times `weights` when given), then `aggregate_loss`. The clipped weight is a constant, so every
    token keeps a gradient -w A grad(logp), clipped or not: unlike PPO, a clipped token is not dropped
    from the update, it is only given a bounded weight. MiniMax-M1 sets no lower bound (the default
    clip_low = 1 makes it 0) and uses the token-mean normalisation. The loss value is the surrogate's
    (it contains logp, so it is not 0 on-policy).

    Shapes and the packed form as in `policy_loss`. Metrics as `policy_loss`'s; ``clip_fraction``
    counts tokens whose weight was clipped (r outside [1 - clip_low, 1 + clip_high]).
    """
    where = "cispo_loss"
    _check_objective_inputs(where, logp, old_logp, mask, weights, segments)
    valid = _as_bool(mask)
    adv = _expand_advantages(advantages.detach().float(), logp).masked_fill(~valid, 0.0)
    log_ratio, ratio = _token_ratio(logp, old_logp, valid)
    r = ratio.detach()
    weight = r.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * adv * logp.float().masked_fill(~valid, 0.0)
    if weights is not None:
        per_token = per_token * weights.detach().float()
    loss = aggregate_loss(per_token, valid, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          segments=segments, num_segments=num_segments)
    metrics = _clip_metrics(r, log_ratio.detach(), valid & (r < 1.0 - clip_low), valid & (r > 1.0 + clip_high), valid)
    return loss, metrics


SAPO_HALVED = 0.5  # a token counts as soft-clipped when the gate leaves less than this share of its gradient


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg: LossAgg = "token-mean",
    weights: torch.Tensor | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347).

    A smooth gate replaces the hard clip. With r = exp(logp - old_logp) per token (log-ratio clamped
    to [-20, 20]) and tau = tau_pos where A > 0, tau_neg otherwise:

        per_token = -A * (4 / tau) * sigmoid(tau * (r - 1))

    (times `weights` when given), then `aggregate_loss`. Its gradient is the plain importance-sampled
    one, -A r grad(logp), times the gate weight g = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1):
    g = 1 on-policy (r = 1) and decays smoothly as r leaves 1, faster for larger tau. The paper's
    defaults are tau_pos = 1.0 and tau_neg = 1.05 (negative advantages decay faster).

    Shapes and the packed form as in `policy_loss`. Metrics as `policy_loss`'s, where a token counts
    as clipped when its gate weight g < 0.5 (the gate removed more than half of its gradient; low for
    r < 1, high for r > 1), plus ``gate_mean``, the mean of g over the valid tokens.
    """
    where = "sapo_loss"
    _check_objective_inputs(where, logp, old_logp, mask, weights, segments)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"{where}: tau_pos={tau_pos} and tau_neg={tau_neg} must be > 0")
    valid = _as_bool(mask)
    adv = _expand_advantages(advantages.detach().float(), logp).masked_fill(~valid, 0.0)
    log_ratio, ratio = _token_ratio(logp, old_logp, valid)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -adv * (4.0 / tau) * gate
    if weights is not None:
        per_token = per_token * weights.detach().float()
    loss = aggregate_loss(per_token, valid, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          segments=segments, num_segments=num_segments)
    g = gate.detach()
    soft_weight = 4.0 * g * (1.0 - g)
    r = ratio.detach()
    halved = valid & (soft_weight < SAPO_HALVED)
    metrics = _clip_metrics(r, log_ratio.detach(), halved & (r < 1.0), halved & (r > 1.0), valid)
    metrics["gate_mean"] = masked_mean(soft_weight, valid)
    return loss, metrics


def objective_loss(
    objective: PolicyLossName,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg: LossAgg = "token-mean",
    weights: torch.Tensor | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `objective` names: ``ppo`` (`policy_loss`, `weights` as its tis_weights),
    ``gspo``, ``cispo`` or ``sapo``. `clip_low`/`clip_high` are that objective's own clip range (unused
    by sapo); `dual_clip` applies to ppo only, `tau_pos`/`tau_neg` to sapo only."""
    _check_choice("objective_loss", "objective", objective, _POLICY_LOSSES)
    common = dict(loss_agg=loss_agg, global_tokens=global_tokens, global_seqs=global_seqs, segments=segments,
                  num_segments=num_segments)
    if objective == "ppo":
        return policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                           dual_clip=dual_clip, tis_weights=weights, **common)
    if objective == "gspo":
        return gspo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, weights=weights,
                         **common)
    if objective == "cispo":
        return cispo_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, weights=weights,
                          **common)
    return sapo_loss(logp, old_logp, advantages, mask, tau_pos=tau_pos, tau_neg=tau_neg, weights=weights, **common)


# --------------------------------------------------------------------------------------------
# rollout / training mismatch corrections

RolloutCorrection = Literal["none", "tis", "icepop", "mis", "seq_mask_tis"]
_ROLLOUT_CORRECTIONS = ("none", "tis", "icepop", "mis", "seq_mask_tis")
CORRECTION_COUNTS = ("tokens", "seqs", "masked_tokens", "masked_seqs", "clipped_tokens", "clipped_seqs", "weight_sum")


@torch.no_grad()
def rollout_correction(
    old_logp_train: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: RolloutCorrection,
    *,
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    mis_cap: float = 2.0,
    seq_mask_low: float = 0.999,
    seq_mask_high: float = 1.002,
    segments: torch.Tensor | None = None,
    num_segments: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss weights that correct for tokens sampled by the engine but trained by the trainer.

    With w_t = exp(old_logp_train - engine_logp) per valid token (log clamped to [-20, 20]):

    - ``none``: 1.
    - ``tis`` (truncated IS): min(w_t, tis_cap); a token is clipped when w_t > tis_cap.
    - ``icepop`` (IcePop, Ling team, Ring-1T): w_t where icepop_low <= w_t <= icepop_high, else 0
      (the token is masked).
    - ``mis`` (sequence-level masked IS, Liu, Li et al. 2025, "When Speed Kills Stability"): the
      sequence's product rho_i = exp(sum_t log w_t) on each of its tokens where rho_i <= mis_cap; the
      whole sequence is masked (0) above it.
    - ``seq_mask_tis`` (NeMo-RL's seq-mask-tis): w_t, with the whole sequence masked when its geometric
      mean exp(mean_t log w_t) leaves [seq_mask_low, seq_mask_high].

    Returns (weights, counts): weights detached float32 in the inputs' shape, 0 outside the mask; counts
    float32 scalars over the valid tokens (sum them over micro-batches and ranks, then divide):
    ``tokens``, ``seqs`` (sequences with a valid token), ``masked_tokens`` and ``masked_seqs`` (weight
    0; for icepop a sequence counts when any of its tokens is masked), ``clipped_tokens`` and
    ``clipped_seqs`` (tis: weight truncated), ``weight_sum`` (sum of the weights). Shapes: (B, T), or
    packed (K,) with `segments`; a sequence-level mode needs whole sequences in one call.
    """
    where = "rollout_correction"
    _check_choice(where, "mode", mode, _ROLLOUT_CORRECTIONS)
    _check_tokens(where, "old_logp_train", old_logp_train, segments)
    _check_same_shape(where, old_logp_train=old_logp_train, engine_logp=engine_logp, mask=mask)
    valid = _as_bool(mask)
    log_w = (old_logp_train.float() - engine_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = torch.where(valid, log_w, torch.zeros((), device=log_w.device))
    w = torch.exp(log_w)
    masked = torch.zeros_like(valid)
    clipped = torch.zeros_like(valid)
    if mode == "none":
        weights = torch.ones_like(w)
    elif mode == "tis":
        clipped = valid & (w > tis_cap)
        weights = w.clamp(max=tis_cap)
    elif mode == "icepop":
        masked = valid & ((w < icepop_low) | (w > icepop_high))
        weights = torch.where(masked, 0.0, w)
    elif mode == "mis":
        seq_log = _per_sequence_sum(log_w, segments, num_segments).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = _per_token(torch.exp(seq_log), w, segments)
        masked = valid & (rho > mis_cap)
        weights = torch.where(masked, 0.0, rho)
    else:
        geo = _per_token(torch.exp(_per_sequence_mean(log_w, valid, segments, num_segments)), w, segments)
        masked = valid & ((geo < seq_mask_low) | (geo > seq_mask_high))
        weights = torch.where(masked, 0.0, w)
    weights = weights.masked_fill(~valid, 0.0)
    return weights, _correction_counts(weights, valid, masked, clipped, segments, num_segments)


def _correction_counts(weights: torch.Tensor, valid: torch.Tensor, masked: torch.Tensor, clipped: torch.Tensor,
                       segments: torch.Tensor | None, num_segments: int | None) -> dict[str, torch.Tensor]:
    def seqs_with(flags: torch.Tensor) -> torch.Tensor:
        return (_per_sequence_sum(flags.float(), segments, num_segments) > 0).sum().to(torch.float32)

    return {
        "tokens": valid.sum().to(torch.float32),
        "seqs": seqs_with(valid),
        "masked_tokens": masked.sum().to(torch.float32),
        "masked_seqs": seqs_with(masked),
        "clipped_tokens": clipped.sum().to(torch.float32),
        "clipped_seqs": seqs_with(clipped),
        "weight_sum": weights.sum().to(torch.float32),
    }
