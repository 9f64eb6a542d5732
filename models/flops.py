"""Language-model training FLOPs and the device's dense bf16 peak, for MFU.

MFU here counts the language model's FLOPs the way EasyR1 and veRL count them: 6·N·tokens with
N the dense parameters (attention and MLP projections of every layer, embedding and lm_head),
plus 12·Σ seqlen²·head_dim·heads·layers for attention, over the device's dense bf16 peak.

Hybrid decoders (Qwen3.5: `layer_types` of linear_attention / full_attention) count each layer's
own projections: Gated DeltaNet's in_proj_qkvz, in_proj_ba and out_proj for a linear layer (its
chunked recurrence and short convolution are left out, as veRL leaves them out), and the quadratic
term for full-attention layers only. A gated output doubles q_proj: `attn_output_gate` where the
config names it, else gated for hybrids (Qwen3.5's config does not name it; its q_proj always carries
the gate). MoE layers count the experts a token goes through (top-k routed plus the shared expert and its
gate) and the router.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks in TFLOP/s (SXM parts), by a name fragment of the device.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def text_config(config):
    return getattr(config, "text_config", None) or config


def output_gated(t) -> bool:
    """Whether a text config's full-attention layers gate their output (q_proj twice as wide):
    `attn_output_gate` where the config names it, else hybrids (linear-attention `layer_types`) do."""
    return getattr(t, "attn_output_gate", "linear_attention" in (getattr(t, "layer_types", None) or []))


def llm_flops(config, seqlens: list[int], attention_pairs: int | None = None) -> float:
    """Training FLOPs (forward + backward) of the language model over sequences of these lengths; with
    `attention_pairs` (query-key pairs counted as a sequence of s tokens counts s², e.g. a shared-prompt row's
    segments) the attention term counts those instead."""
    t = text_config(config)
    h, heads = t.hidden_size, t.num_attention_heads
    kv = getattr(t, "num_key_value_heads", None) or heads
    try:
        head_dim = getattr(t, "head_dim", None) or h // heads
    except RuntimeError:  # a per-layer attribute (Gemma4's heads differ by layer type): the first layer's
        head_dim = t.per_layer_config[0].head_dim
    layers = t.num_hidden_layers
    kinds = list(getattr(t, "layer_types", None) or ["full_attention"] * layers)
    full = sum(1 for k in kinds if k != "linear_attention")
    q = heads * head_dim * (2 if output_gated(t) else 1)
    attn_proj = h * (q + 2 * kv * head_dim + heads * head_dim)
    linear_proj = 0
    if full < layers:
        nk, nv = t.linear_num_key_heads, t.linear_num_value_heads
        kd, vd = t.linear_key_head_dim, t.linear_value_head_dim
        linear_proj = h * (2 * nk * kd + 2 * nv * vd) + h * 2 * nv + nv * vd * h
    if getattr(t, "num_experts", 0):
        mlp = 3 * h * t.moe_intermediate_size * t.num_experts_per_tok + h * t.num_experts
        shared = getattr(t, "shared_expert_intermediate_size", 0) or 0
        mlp += (3 * shared + 1) * h if shared else 0  # the shared expert and its sigmoid gate
    else:
        mlp = 3 * h * t.intermediate_size
    dense = mlp * layers + attn_proj * full + linear_proj * (layers - full) + 2 * t.vocab_size * h
    pairs = sum(s * s for s in seqlens) if attention_pairs is None else attention_pairs
    attn = 12 * pairs * head_dim * heads * full
    return 6.0 * dense * sum(seqlens) + attn


def row_flops(config, microbatches) -> float:
    """`llm_flops` of packed rows as they run (PackedMicrobatch-like: `num_tokens`, `attention_pairs()`): each
    token once, each segment's queries over its keys; for unshared rows the sequences' own count."""
    return llm_flops(config, [mb.num_tokens for mb in microbatches],
                     sum(mb.attention_pairs() for mb in microbatches))


def peak_tflops(device: torch.device) -> float:
    """The device's dense bf16 peak, or 0 where unknown (CPU, other GPUs): then no MFU is reported."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
