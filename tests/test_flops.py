"""Training FLOPs of hybrid and MoE decoders, counted by hand."""

from types import SimpleNamespace

import pytest

from models.flops import llm_flops


def test_hybrid_linear_attention_counts_each_layer_kind():
    # two Gated DeltaNet layers and one gated full-attention layer
    t = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        intermediate_size=16, num_hidden_layers=3, vocab_size=10, attn_output_gate=True,
                        layer_types=["linear_attention", "linear_attention", "full_attention"],
                        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                        linear_value_head_dim=4)
    mlp = 3 * 8 * 16
    full = 8 * (2 * 8 + 2 * 4 + 8)  # q doubled by the output gate, k, v, o
    linear = 8 * (2 * 4 + 2 * 8) + 8 * 2 * 2 + 8 * 8  # in_proj_qkvz, in_proj_ba, out_proj
    dense = 3 * mlp + full + 2 * linear + 2 * 10 * 8
    seqlens = [5, 3]
    expected = 6 * dense * 8 + 12 * (25 + 9) * 4 * 2 * 1  # the quadratic term of the one full layer
    assert llm_flops(SimpleNamespace(text_config=t), seqlens) == expected


def test_moe_counts_the_experts_a_token_uses():
    t = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=999,
                        num_hidden_layers=1, vocab_size=10, num_experts=16, num_experts_per_tok=2,
                        moe_intermediate_size=4, shared_expert_intermediate_size=6)
    mlp = 3 * 8 * 4 * 2 + 8 * 16 + 3 * 8 * 6 + 8  # routed experts, router, shared expert and its gate
    attn = 8 * (8 + 8 + 8 + 8)
    expected = 6 * (mlp + attn + 2 * 10 * 8) * 4 + 12 * 16 * 4 * 2
    assert llm_flops(t, [4]) == expected


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_count_matches_the_models_own_projections(family, tmp_path):
    """The dense term is the language model's own linear weights (every decoder projection, experts a token
    uses, router) plus embedding and lm_head: checked against the modules transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModel

    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / family, family=family, size="tiny", seed=0)
    t = AutoConfig.from_pretrained(folder).text_config
    with torch.device("meta"):
        model = AutoModel.from_config(t)
    linear = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            linear += module.weight.numel()
    experts = getattr(t, "num_experts", 0)
    if experts:  # fused experts: count the ones a token goes through; the router's weight
        for name, param in model.named_parameters():
            if ".experts." in name:
                linear += param.numel() // experts * t.num_experts_per_tok
            elif name.endswith("mlp.gate.weight"):
                linear += param.numel()
    heads, full = t.num_attention_heads, sum(k == "full_attention" for k in t.layer_types)
    dense = (llm_flops(t, [1]) - 12 * t.head_dim * heads * full) / 6
    assert dense == linear + 2 * t.vocab_size * t.hidden_size
