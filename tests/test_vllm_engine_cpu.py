"""The vLLM engine's code that runs without vLLM: the refit stream, its check, the KV cap, the shim."""

import json

import pytest
import torch

from rollout.vllm_engine import (
    FLEX_BLOCK_MAP_BYTES,
    FLEX_MAX_NUM_SEQS,
    KV_BLOCK_TOKENS,
    check_loaded,
    flex_kv_cap_bytes,
    kv_bytes_per_token,
    refit_stream,
    vllm_compat,
)
from rollout.weight_names import VLLMSkips, vllm_load_name, vllm_param_for

H200_BYTES = 143_771_090_944


def _llava_config(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "llava", family="llava", size="tiny", seed=0)
    return json.loads((path / "config.json").read_text())


def test_refit_stream_predicts_params_and_counts_skips(tmp_path):
    config = _llava_config(tmp_path)
    skips = VLLMSkips.for_config("llava", config)
    last = config["vision_config"]["num_hidden_layers"] - 1
    names = [
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.layers.0.self_attn.k_proj.weight",
        f"model.vision_tower.encoder.layers.{last}.mlp.fc1.weight",  # past vision_feature_layer=-2
        "lm_head.weight",
    ]
    tensors = [(n, torch.ones(2, 2, requires_grad=True)) for n in names]
    expected, skipped = set(), {}
    out = list(refit_stream("llava", skips, False, tensors, expected, skipped))
    assert [n for n, _ in out] == [vllm_load_name("llava", n) for n in names]  # skipped ones still go to vLLM
    assert all(not t.requires_grad for _, t in out)
    assert set(skipped) == {names[2]}
    # q and k stack into one vLLM parameter: the prediction is by parameter, not by tensor
    assert expected == {vllm_param_for("llava", names[0])[0], vllm_param_for("llava", "lm_head.weight")[0]}
    # with a tied head, vLLM drops lm_head.*: it is not expected back
    expected_tied = set()
    list(refit_stream("llava", skips, True, tensors, expected_tied, {}))
    assert vllm_param_for("llava", "lm_head.weight")[0] not in expected_tied


def test_refit_stream_rejects_non_tensors_and_foreign_names(tmp_path):
    skips = VLLMSkips.for_config("llava", _llava_config(tmp_path))
    with pytest.raises(TypeError, match="lm_head.weight is a list"):
        list(refit_stream("llava", skips, False, [("lm_head.weight", [1.0])], set(), {}))
    with pytest.raises(ValueError, match="transformer.h.0.mlp.weight"):
        list(refit_stream("llava", skips, False, [("transformer.h.0.mlp.weight", torch.zeros(1))], set(), {}))


def test_check_loaded_names_what_is_missing_and_extra():
    check_loaded({"a", "b"}, {"a", "b"})
    with pytest.raises(RuntimeError, match=r"did not load \['b'\] \(1 in all\) and loaded unexpected \['c'\]"):
        check_loaded({"a", "c"}, {"a", "b"})


def _gemma3(layers=34, kv_heads=4, head_dim=256):
    return {"model_type": "gemma3", "text_config": {"num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                                                    "head_dim": head_dim, "num_attention_heads": 8,
                                                    "hidden_size": 2560}}


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    assert kv_bytes_per_token(_gemma3(), 2) == 2 * 34 * 4 * 256 * 2
    # head_dim from hidden_size / heads when the config leaves it out; kv heads default to heads
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 4) == 2 * 2 * 4 * 16 * 4


def test_flex_cap_binds_for_tiny_models_only():
    tiny = _gemma3(layers=2, kv_heads=2, head_dim=16)
    cap = flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES)
    assert cap is not None
    blocks = cap // (KV_BLOCK_TOKENS * kv_bytes_per_token(tiny, 2))
    assert blocks * FLEX_MAX_NUM_SEQS * 8 <= FLEX_BLOCK_MAP_BYTES  # the block map fits its budget
    assert flex_kv_cap_bytes(_gemma3(), 2, 0.5, H200_BYTES) is None  # Gemma3-4B: the cap would not bind
    qwen = {**tiny, "model_type": "qwen2_5_vl"}
    assert flex_kv_cap_bytes(qwen, 2, 0.5, H200_BYTES) is None  # no FlexAttention block map to bound


def test_vllm_compat_touches_nothing_for_other_families():
    assert vllm_compat("qwen2_5_vl") == []
    assert vllm_compat("gemma3") == []


def test_flex_cap_is_per_gpu_under_tensor_parallelism():
    tiny = _gemma3(layers=2, kv_heads=2, head_dim=16)
    one = flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES)
    assert flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES, tensor_parallel_size=2) == one // 2
    # more GPUs than KV heads: heads are replicated, a GPU still holds one head's share
    assert flex_kv_cap_bytes(tiny, 2, 0.5, H200_BYTES, tensor_parallel_size=4) == one // 2
