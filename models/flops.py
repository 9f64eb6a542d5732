"""Language-model training FLOPs and the device's dense bf16 peak, for MFU.

MFU here counts the language model's FLOPs the way EasyR1 and veRL count them: 6·N·tokens with
N the dense parameters (attention and MLP projections of every layer, embedding and lm_head),
plus 12·Σ seqlen²·head_dim·heads·layers for attention, over the device's dense bf16 peak.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks in TFLOP/s (SXM parts), by a name fragment of the device.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def text_config(config):
    return getattr(config, "text_config", None) or config


def llm_flops(config, seqlens: list[int]) -> float:
    """Training FLOPs (forward + backward) of the language model over sequences of these lengths."""
    t = text_config(config)
    h, heads = t.hidden_size, t.num_attention_heads
    kv = getattr(t, "num_key_value_heads", None) or heads
    head_dim = getattr(t, "head_dim", None) or h // heads
    mlp = 3 * h * t.intermediate_size
    attn_linear = h * (heads * head_dim + 2 * kv * head_dim + heads * head_dim)
    dense = (mlp + attn_linear) * t.num_hidden_layers + 2 * t.vocab_size * h
    attn = 12 * sum(s * s for s in seqlens) * head_dim * heads * t.num_hidden_layers
    return 6.0 * dense * sum(seqlens) + attn


def peak_tflops(device: torch.device) -> float:
    """The device's dense bf16 peak, or 0 where unknown (CPU, other GPUs): then no MFU is reported."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
