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
