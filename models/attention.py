"""The "varlen" attention implementation: packed rows through FlashAttention's variable-length kernel.

`model.attn_implementation: varlen` registers this with transformers. In a packed row the plain
positions restart at 0 where each sequence starts; from them the function builds the cumulative
sequence lengths and calls `torch.nn.attention.varlen.varlen_attn`, causal within each sequence
and never across. sdpa over a packed row needs a block-diagonal mask instead, which computes the
whole row's L² scores (for 12 sequences of 1.3k tokens in a 16k row, 13× the useful work).

Where the kernel cannot run (CPU, a torch without it) a packed row's attention runs each sequence on its
own through SDPA (`reference_attention`): the same function, Σ Lᵢ² scores instead of the row's L² (on 2 CPU
cores, 16 sequences in a 1,392-token row of a 36-layer model: the update's step 2.35 s against 3.95 s under
the row's mask). Without positions, over a cached decode or with a mask the family built itself the call
falls back to transformers' sdpa path, with the mask transformers builds for sdpa. Where the policy hands the
decoder its masks (`prebuilt_masks`) none is built for this attention (it would be an L×L tensor nobody
reads).

Within a packed row or a vision tower's forward nothing here reads a tensor back from the device per layer:
a read (`.tolist()`, `int()`) waits until the device has run everything queued before it, and the device then
idles while the host queues the next kernels. The kernels take the longest sequence as a Python int, from the
boundaries' values on the host (`host_bounds`): the packer's (`packed_row`) and those the vision tower's family
computes from the host's copy of the image grid (`image_grid`), else read back once per boundary tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import torch
from torch.utils.weak import WeakIdKeyDictionary

from models.moe import current_routes, routes_as

NAME = "varlen"
_ROW: contextvars.ContextVar = contextvars.ContextVar("vlrl_packed_row", default=None)
_GRID: contextvars.ContextVar = contextvars.ContextVar("vlrl_image_grid", default=None)
# boundary tensor → its values as Python ints, for as long as the tensor lives (boundaries are never changed
# in place); keyed by identity, so a tensor's values are read back from the device at most once
_BOUNDS = WeakIdKeyDictionary()
VISION_NAME = "flash_varlen_vision"  # "flash" in the name: transformers passes cu_seqlens to it


@functools.cache
def _kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def kernel_available() -> bool:
    return _kernel()[0] is not None


def kernel_runs(device: torch.device | str) -> bool:
    """Whether attention on this device runs the varlen kernel (CUDA with torch's kernel) rather than SDPA."""
    return _kernel()[0] is not None and torch.device(device).type == "cuda"


def remember_bounds(cu: torch.Tensor, values) -> None:
    """Record the values (ints) of a tensor of sequence boundaries, known on the host where it was made, so
    that no later reader (`host_bounds`) reads them back from the device."""
    _BOUNDS[cu] = tuple(int(v) for v in values)


def host_bounds(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of a tensor of sequence boundaries as Python ints: those recorded with `remember_bounds`,
    else read back once (a device sync) and kept for the tensor's lifetime. Every layer of a row, and every
    block of a vision tower (its two tensors: windows and whole images), asks for the same tensor."""
    known = _BOUNDS.get(cu)
    if known is None:
        known = _BOUNDS[cu] = tuple(cu.tolist())
    return known


def longest_of(bounds) -> int:
    """The longest sequence between consecutive boundaries (ints), 0 for none."""
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)


def _longest(cu: torch.Tensor) -> int:
    return longest_of(host_bounds(cu))


def _cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths (N+1,) int32 and the longest length of the sequences in a packed row,
    from its positions (each sequence restarts at 0). Costs a device sync: the policy gives the
    boundaries it already has through `packed_row` instead, so this runs only outside it (an
    activation-checkpointing recompute, a caller other than the policy)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    total = torch.tensor([pos.numel()], device=pos.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, _longest(cu)


@contextlib.contextmanager
def packed_row(cu_seqlens: torch.Tensor, length: int, kv_index: torch.Tensor | None = None,
               cu_seqlens_k: torch.Tensor | None = None, bounds=None, bounds_k=None):
    """Within this block, varlen attention over a row of `length` tokens uses these sequence
    boundaries (the packer's own) rather than deriving them from positions in every layer. With
    `kv_index` (a row with shared prompts, `models.packing.pack_shared`) the boundaries are query
    segments and segment s attends to the row positions kv_index[cu_seqlens_k[s]:cu_seqlens_k[s + 1]].
    `bounds` / `bounds_k`: the values of cu_seqlens / cu_seqlens_k as ints, where the caller has them on
    the host (then nothing is read back from the device)."""
    cu = cu_seqlens.to(torch.int32)
    if bounds is not None:
        remember_bounds(cu, bounds)
    keys = None
    if kv_index is not None:
        cu_k = cu_seqlens_k.to(device=cu.device, dtype=torch.int32)
        if bounds_k is not None:
            remember_bounds(cu_k, bounds_k)
        keys = (kv_index.to(cu.device), cu_k, _longest(cu_k))
    with _row_as((cu, _longest(cu), int(length), keys)):
        yield


@contextlib.contextmanager
def _row_as(row):
    token = _ROW.set(row)
    try:
        yield
    finally:
        _ROW.reset(token)


@contextlib.contextmanager
def image_grid(rows):
    """Within this block, a vision tower's forward over images with these patch grids (one list of ints per
    `image_grid_thw` row, the host's copy) can take its attention windows from them (`given_grid`) rather
    than from the grid on the device."""
    token = _GRID.set([list(r) for r in rows])
    try:
        yield
    finally:
        _GRID.reset(token)


def given_grid(count: int) -> list[list[int]] | None:
    """The patch grid rows `image_grid` gave for a forward over `count` images, else None."""
    rows = _GRID.get()
    return rows if rows is not None and len(rows) == count else None


def checkpoint_context():
    """`context_fn` for activation checkpointing: the backward's recompute of a layer sees the
    packed row (and the MoE routes it replays) its forward saw (backward runs after those blocks
    have closed)."""
    return contextlib.nullcontext(), _recompute_as(_ROW.get(), current_routes())


@contextlib.contextmanager
def _recompute_as(row, routes):
    with _row_as(row), routes_as(routes):
        yield


def given_row(length: int) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens, longest) that `packed_row` gave for a row of this length; None outside such a
    block (linear-attention layers read it: they see no positions)."""
    given = _ROW.get()
    if given is not None and given[2] == length:
        return given[0], given[1]
    return None


def shared_keys(length: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(kv_index, cu_seqlens_k, longest key segment) of a row with shared prompts of this length, else None."""
    given = _ROW.get()
    return given[3] if given is not None and given[2] == length else None


def shared_prompt_attention(query, key, value, cu: torch.Tensor, longest: int, keys, scaling) -> torch.Tensor:
    """Attention over a row with shared prompts: query (1, H, L, D), key/value (1, Hkv, L, D) → (1, L, H, D).
    Query segment s attends to the rows keys[0][cu_k[s]:cu_k[s + 1]], causally with the segment's queries
    aligned to the last keys (a response's first token sees its whole prompt). On CUDA with the kernel: one
    varlen call over the gathered keys; elsewhere SDPA per segment (`reference_attention`)."""
    kv_index, cu_k, longest_k = keys
    if kernel_runs(query.device):
        # FlashAttention aligns a causal mask to the last key where keys outnumber queries; checked once
        _check_end_alignment(query.device)
        return _run_kernel(query, key, value, cu, longest, scaling, True, (kv_index, cu_k, longest_k))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return reference_attention(q, k, v, cu, scaling, keys).unsqueeze(0)


@functools.cache
def _check_end_alignment(device: torch.device) -> None:
    """Once per device: the varlen kernel's causal mask over more keys than queries is aligned to the last
    key (the last query sees every key), as a shared prompt's row needs; raises where it is not."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g, device=device, dtype=torch.bfloat16) for n in (3, 8, 8))
    cu_q, cu_k = (torch.tensor([0, n], device=device, dtype=torch.int32) for n in (3, 8))
    got = _run_kernel(q, k, v, cu_q, 3, None, True, (torch.arange(8, device=device), cu_k, 8))[0].transpose(0, 1)
    visible = torch.ones(3, 8, dtype=torch.bool, device=device).tril(5)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible)[0]
    if not torch.allclose(got.float(), want, atol=3e-2):
        raise RuntimeError(f"torch {torch.__version__}'s varlen attention does not align a causal mask to the last "
                           "key; model.shared_prompts cannot run on it: set it to off")


def row_boundaries(position_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
    """The boundaries `packed_row` gave for a row of this length, else derived from the positions."""
    given = given_row(length)
    return given if given is not None else _cu_seqlens(position_ids)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers attention interface: query (1, H, L, D), key/value (1, Hkv, L, D) → ((1, L, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    keys = shared_keys(query.shape[2]) if query.shape[0] == 1 and causal else None
    if keys is not None:  # a row with shared prompts: the segments' own keys, whatever mask was built
        cu, longest = given_row(query.shape[2])
        return shared_prompt_attention(query, key, value, cu, longest, keys, scaling), None
    per_sequence = (position_ids is not None and query.shape[0] == 1 and causal and not dropout
                    and attention_mask is None and key.shape[2] == query.shape[2])
    if not per_sequence:  # a family's own mask wins, as do a cached decode and a padded batch
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    cu, longest = row_boundaries(position_ids, query.shape[2])
    if not kernel_runs(query.device):  # off the kernel: each sequence of the row on its own
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return reference_attention(q, k, v, cu, scaling).unsqueeze(0), None
    return _run_kernel(query, key, value, cu, longest, scaling, causal=True), None


def _run_kernel(query, key, value, cu: torch.Tensor, longest: int, scaling, causal: bool, keys=None) -> torch.Tensor:
    """The varlen kernel over one row: query (1, H, L, D), key/value (1, Hkv, L, D) → (1, L, H, D). `keys`
    (kv_index, cu_seqlens_k, longest key segment): each query segment's own keys, gathered from the row."""
    kernel, params = _kernel()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, heads, D)
    cu_k, longest_k = cu, longest
    if keys is not None:
        k, v = k.index_select(0, keys[0]), v.index_select(0, keys[0])
        cu_k, longest_k = keys[1], keys[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _DIRECT_FLASH[0]:
        return FlashVarlen.apply(q, k, v, cu, cu_k, longest, longest_k, scaling, causal).unsqueeze(0)
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if "is_causal" in params:
        extra["is_causal"] = causal
    else:
        extra["window_size"] = (-1, 0) if causal else (-1, -1)
    return kernel(q, k, v, cu, cu_k, longest, longest_k, scale=scaling, **extra).unsqueeze(0)


# model.flash_direct (set_direct_flash): the kernel called through FlashVarlen instead of torch's varlen_attn
_DIRECT_FLASH = [False]


def set_direct_flash(on: bool) -> None:
    """model.flash_direct, for the whole process (the policy and its reference share the attention functions)."""
    _DIRECT_FLASH[0] = bool(on)


def _flash_ops():
    """(forward, backward): torch's FlashAttention varlen ops, the ones `varlen_attn` calls (a seam for tests)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


class FlashVarlen(torch.autograd.Function):
    """torch's FlashAttention varlen kernels called directly (model.flash_direct): q (L, H, D), k/v (Lk, Hkv, D)
    with H a multiple of Hkv → (L, H, D). The kernel reads grouped K/V heads itself (torch 2.11's `varlen_attn`
    has no `enable_gqa`, so the other path repeats them to H heads first and sums their gradients back), and
    the call skips `varlen_attn`'s custom-operator layer: a plain autograd function, fewer host steps a layer."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, causal: bool):
        forward, _ = _flash_ops()
        out, lse, rng, unused, _ = forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.shape = (max_q, max_k, scale, causal)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _, backward = _flash_ops()
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, scale, causal = ctx.shape
        dq, dk, dv = backward(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng,
                              unused, scale=scale)
        return dq, dk, dv, None, None, None, None, None, None


def varlen_vision_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                            is_causal=None, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Bidirectional attention within each window of a vision tower: query/key/value (1, H, L, D),
    windows given by `cu_seq_lens_q` (N+1,) → ((1, L, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:  # a caller without windows: the whole row is one window
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=False)
    if not kernel_runs(query.device) or dropout or query.shape[0] != 1:
        bounds = host_bounds(cu_seq_lens_q)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        parts = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=False)[0]
                 for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))]
        return torch.cat(parts, dim=1), None
    cu = cu_seq_lens_q.to(torch.int32)
    return _run_kernel(query, key, value, cu, vision_longest(cu_seq_lens_q, max_length_q), scaling,
                       causal=False), None


def vision_longest(cu_seq_lens_q: torch.Tensor, max_length_q) -> int:
    """The longest window of a vision block's call. transformers 5.17 and later pass it as an int, computed once
    per tower forward; earlier versions as a fresh device tensor in every block, which is not read: the
    windows' boundaries are the same tensor in every block (`host_bounds` reads it at most once)."""
    if max_length_q is None or isinstance(max_length_q, torch.Tensor):
        return _longest(cu_seq_lens_q)
    return int(max_length_q)


def _mask(*args, **kwargs):
    """No mask for the kernel (it takes sequence boundaries); sdpa's mask where the call falls back."""
    from transformers.masking_utils import sdpa_mask

    device = kwargs.get("device")
    if device is not None and kernel_runs(device):
        return None
    return sdpa_mask(*args, **kwargs)


def prebuilt_masks(config, device) -> dict | None:
    """The `attention_mask` to hand a transformers decoder whose attention is "varlen", over a packed row: no mask
    for each of its layer types, given as already built, so transformers skips building them and the packed-row
    check it makes first (a read back from the device). The kernel takes the row's boundaries instead, and off
    the kernel each sequence runs on its own (`varlen_attention`). None for another attention."""
    types = getattr(config, "layer_types", None)
    if getattr(config, "_attn_implementation", None) != NAME or not types:
        return None
    return dict.fromkeys(types)


def register() -> str:
    """Make `attn_implementation="varlen"` known to transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _mask)
    AttentionInterface.register(VISION_NAME, varlen_vision_attention)
    AttentionMaskInterface.register(VISION_NAME, _mask)
    return NAME


# --- vLLM's FlashAttention on the paged layout (model.attn_implementation=vllm_paged; rollout.exact) -------------
# The engine runs causal attention as vllm_flash_attn's flash_attn_varlen_func over its paged KV cache; with one
# KV split (what vLLM's batch-invariant mode sets) the result does not depend on how the query rows are tiled,
# so a training row computed as one prefill of all its sequences matches the engine's prefill and decode.
ENGINE_FLASH_NAME = "vllm_paged"  # no "flash" in it: transformers takes such names for its own kernels
KV_BLOCK = 16  # vLLM's KV block size (rollout.exact sets it in the engine; the policy pages K/V the same)


def paged_kv(k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, block: int = KV_BLOCK):
    """A packed row's K/V (L, Hkv, D) laid out as vLLM's KV cache: (blocks, block, Hkv, D) each, plus the block
    table (N, max blocks) int32 and the sequence lengths (N,) int32. Sequence i's token j sits in block
    table[i, j // block] at offset j % block; blocks past a sequence's end are zero."""
    lengths = (cu[1:] - cu[:-1]).to(torch.int64)
    per_seq = (lengths + block - 1) // block
    bounds = host_bounds(cu)  # the table's shape, without reading the device's lengths back in every layer
    blocks = [(b - a + block - 1) // block for a, b in zip(bounds[:-1], bounds[1:])]
    width, total = max(blocks), sum(blocks)
    first = torch.cumsum(per_seq, 0) - per_seq  # each sequence's first block
    columns = torch.arange(width, device=k.device)
    table = torch.where(columns < per_seq[:, None], first[:, None] + columns, 0).to(torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=k.device), lengths, output_size=k.shape[0])
    slot = first[seq] * block + torch.arange(k.shape[0], device=k.device) - cu[:-1].to(torch.int64)[seq]
    k_cache, v_cache = (t.new_zeros(total * block, *t.shape[1:]).index_copy_(0, slot, t)
                        .view(total, block, *t.shape[1:]) for t in (k, v))
    return k_cache, v_cache, table, lengths.to(torch.int32)


@functools.cache
def _vllm_flash_kernel():
    """(vLLM's flash_attn_varlen_func, the FlashAttention version it runs) or None without vLLM's build."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    version = None
    places = (lambda: __import__("vllm.v1.attention.backends.fa_utils", fromlist=["get_flash_attn_version"]),
              lambda: __import__("vllm.attention.utils.fa_utils", fromlist=["get_flash_attn_version"]))
    for place in places:
        try:
            version = place().get_flash_attn_version()
            break
        except (ImportError, AttributeError, TypeError, RuntimeError):
            continue
    return flash_attn_varlen_func, version


def paged_flash(q, k, v, cu, longest: int, scale: float, kernel=None, block: int = KV_BLOCK) -> torch.Tensor:
    """Causal attention over a packed row through the paged call vLLM's FlashAttention backend makes:
    q (L, H, D), k/v (L, Hkv, D), one KV split → (L, H, D). `kernel` defaults to vLLM's function."""
    fa_version = None
    if kernel is None:
        kernel, fa_version = _vllm_flash_kernel()
    k_cache, v_cache, table, lengths = paged_kv(k, v, cu, block)
    extra = {"fa_version": fa_version} if fa_version is not None else {}
    return kernel(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu.to(torch.int32), max_seqlen_q=longest,
                  seqused_k=lengths, max_seqlen_k=longest, softmax_scale=scale, causal=True, block_table=table,
                  num_splits=1, **extra)


def reference_attention(q, k, v, cu, scale: float | None, keys=None) -> torch.Tensor:
    """Causal attention of each sequence of a packed row on its own (torch SDPA): q (L, H, D) → (L, H, D).
    With `keys` (kv_index, cu_seqlens_k, _) segment s attends to the rows kv_index[cu_k[s]:cu_k[s + 1]], the
    causal mask aligned to the last key (a shared prompt's row)."""
    out = []
    bounds = host_bounds(cu)
    kbounds = host_bounds(keys[1]) if keys is not None else bounds
    for s in range(len(bounds) - 1):
        qs = q[bounds[s]:bounds[s + 1]].transpose(0, 1).unsqueeze(0)
        rows = slice(kbounds[s], kbounds[s + 1]) if keys is None else keys[0][kbounds[s]:kbounds[s + 1]]
        ks, vs = (t[rows].transpose(0, 1).unsqueeze(0) for t in (k, v))
        if ks.shape[1] != qs.shape[1]:
            ks, vs = (t.repeat_interleave(qs.shape[1] // t.shape[1], dim=1) for t in (ks, vs))
        lq, lk = qs.shape[2], ks.shape[2]
        mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        attended = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                                    scale=scale)
        out.append(attended[0].transpose(0, 1))
    return torch.cat(out)


class _EngineKernelAttention(torch.autograd.Function):
    """Forward: the engine's kernel (bitwise the engine's). Backward: recomputed through torch's attention, the
    varlen kernel over the whole row where it runs (one call per layer), else SDPA per sequence."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest, scale):
        ctx.save_for_backward(q, k, v, cu)
        ctx.scale, ctx.longest = scale, longest
        return paged_flash(q, k, v, cu, longest, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            if kernel_runs(q.device):
                out = _run_kernel(*(t.transpose(0, 1).unsqueeze(0) for t in leaves), cu, ctx.longest, ctx.scale,
                                  causal=True)[0]
            else:
                out = reference_attention(*leaves, cu, ctx.scale)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
        return dq, dk, dv, None, None, None


def engine_flash_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    """transformers attention interface `vllm_paged`: the language model's causal attention through the call
    vLLM's FlashAttention backend makes (paged K/V, one KV split; `paged_flash`), (1, H, L, D) → ((1, L, H, D),
    None). The row's sequence boundaries come from `packed_row`. Without CUDA or vLLM's build, the same
    math through SDPA per sequence (`reference_attention`)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not causal:  # a vision tower's windows: bidirectional, through SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=False)
    if query.shape[0] != 1 or dropout:
        raise RuntimeError("vllm_paged attention takes one packed row without dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    position_ids = kwargs.get("position_ids")
    length = query.shape[2]
    if position_ids is None:
        cu, longest = torch.tensor([0, length], device=query.device, dtype=torch.int32), length
    else:
        cu, longest = row_boundaries(position_ids, length)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _vllm_flash_kernel() is not None:
        out = _EngineKernelAttention.apply(q, k, v, cu.to(q.device), longest, scale)
    else:
        out = reference_attention(q, k, v, cu.to(q.device), scale)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register_engine_flash() -> str:
    """Make `attn_implementation="vllm_paged"` known to transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ENGINE_FLASH_NAME, engine_flash_attention)
    AttentionMaskInterface.register(ENGINE_FLASH_NAME, _no_mask)
    return ENGINE_FLASH_NAME
