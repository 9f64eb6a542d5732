"""Training FLOPs of hybrid and MoE decoders, counted by hand."""

from types import SimpleNamespace

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
    mlp = 3 * 8 * 4 * 2 + 8 * 16 + 3 * 8 * 6
    attn = 8 * (8 + 8 + 8 + 8)
    expected = 6 * (mlp + attn + 2 * 10 * 8) * 4 + 12 * 16 * 4 * 2
    assert llm_flops(t, [4]) == expected
