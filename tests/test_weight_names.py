"""The transformers → vLLM weight-name table and the image-placeholder collapse, on CPU."""

import functools

import pytest
import torch
import transformers
from safetensors import safe_open

from rollout.weight_names import (
    SHARD_IDS,
    STACKED,
    collapse_image_pads,
    hf_to_vllm_name,
    vllm_param_for,
)

# The Qwen2/2.5-VL rows, pinned name by name here; every other family's row is checked against
# that family's own tiny model in tests/test_families.py.
FAMILIES = ["qwen2_5_vl", "qwen2_vl"]
LAYER0 = "model.language_model.layers.0"


# --- concrete names, both families ------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "hf_name, vllm_name, shard",
    [
        (f"{LAYER0}.self_attn.q_proj.weight", "language_model.model.layers.0.self_attn.qkv_proj.weight", "q"),
        (f"{LAYER0}.self_attn.k_proj.bias", "language_model.model.layers.0.self_attn.qkv_proj.bias", "k"),
        (f"{LAYER0}.self_attn.v_proj.weight", "language_model.model.layers.0.self_attn.qkv_proj.weight", "v"),
        (f"{LAYER0}.self_attn.o_proj.weight", "language_model.model.layers.0.self_attn.o_proj.weight", None),
        (f"{LAYER0}.mlp.gate_proj.weight", "language_model.model.layers.0.mlp.gate_up_proj.weight", 0),
        (f"{LAYER0}.mlp.up_proj.weight", "language_model.model.layers.0.mlp.gate_up_proj.weight", 1),
        (f"{LAYER0}.mlp.down_proj.weight", "language_model.model.layers.0.mlp.down_proj.weight", None),
        (f"{LAYER0}.input_layernorm.weight", "language_model.model.layers.0.input_layernorm.weight", None),
        ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight", None),
        ("model.language_model.norm.weight", "language_model.model.norm.weight", None),
        ("lm_head.weight", "language_model.lm_head.weight", None),
        ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight", None),
        ("model.visual.blocks.0.attn.qkv.bias", "visual.blocks.0.attn.qkv.bias", None),
        ("model.visual.blocks.0.attn.proj.weight", "visual.blocks.0.attn.proj.weight", None),
        ("model.visual.blocks.0.norm1.weight", "visual.blocks.0.norm1.weight", None),
        ("model.visual.patch_embed.proj.weight", "visual.patch_embed.proj.weight", None),
        ("model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight", None),
        ("model.visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight", None),
        ("model.visual.merger.mlp.2.bias", "visual.merger.mlp.2.bias", None),
    ],
)
def test_shared_names(family, hf_name, vllm_name, shard):
    assert vllm_param_for(family, hf_name) == (vllm_name, shard)


def test_qwen2_5_vision_mlp_is_stacked_like_the_decoder():
    # Qwen2.5-VL's gated vision MLP becomes vLLM's gate_up_proj, as in Qwen2_5_VisionMLP.
    assert vllm_param_for("qwen2_5_vl", "model.visual.blocks.3.mlp.gate_proj.weight") == (
        "visual.blocks.3.mlp.gate_up_proj.weight", 0)
    assert vllm_param_for("qwen2_5_vl", "model.visual.blocks.3.mlp.up_proj.bias") == (
        "visual.blocks.3.mlp.gate_up_proj.bias", 1)
    assert vllm_param_for("qwen2_5_vl", "model.visual.blocks.3.mlp.down_proj.weight") == (
        "visual.blocks.3.mlp.down_proj.weight", None)


def test_qwen2_vision_mlp_keeps_fc1_fc2():
    assert vllm_param_for("qwen2_vl", "model.visual.blocks.1.mlp.fc1.weight") == (
        "visual.blocks.1.mlp.fc1.weight", None)
    assert vllm_param_for("qwen2_vl", "model.visual.blocks.1.mlp.fc2.bias") == ("visual.blocks.1.mlp.fc2.bias", None)


def test_prefix_mapping_without_stacking():
    assert hf_to_vllm_name("qwen2_5_vl", f"{LAYER0}.self_attn.q_proj.weight") == (
        "language_model.model.layers.0.self_attn.q_proj.weight")
    assert hf_to_vllm_name("qwen2_vl", "model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    # Only the leading prefix is rewritten, never a later occurrence of the same text.
    assert hf_to_vllm_name("qwen2_vl", "lm_head.lm_head.weight") == "language_model.lm_head.lm_head.weight"


def test_stacking_table_matches_shard_ids():
    assert STACKED == [("qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("gate_up_proj", ["gate_proj", "up_proj"]),
                       ("in_proj_qkvz", ["in_proj_qkv", "in_proj_z"]), ("in_proj_ba", ["in_proj_b", "in_proj_a"])]
    for _, members in STACKED:
        assert [SHARD_IDS[m] for m in members] in (["q", "k", "v"], [0, 1], [(0, 1, 2), 3])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "module_name, file_name",
    [
        (f"{LAYER0}.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        (f"{LAYER0}.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.language_model.norm.weight", "model.norm.weight"),
        ("model.visual.blocks.0.attn.qkv.bias", "visual.blocks.0.attn.qkv.bias"),
        ("model.visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight"),
    ],
)
def test_checkpoint_file_names_land_where_module_names_do(family, module_name, file_name):
    assert vllm_param_for(family, file_name) == vllm_param_for(family, module_name)


@pytest.mark.parametrize(
    "bad",
    ["language_model.model.layers.0.self_attn.qkv_proj.weight", "language_model.lm_head.weight",
     "transformer.h.0.attn.weight", "vision_tower.blocks.0.attn.qkv.weight"],
)
def test_foreign_names_fail_with_the_name(bad):
    with pytest.raises(ValueError, match="not a transformers") as err:
        vllm_param_for("qwen2_5_vl", bad)
    assert bad in str(err.value)


def test_unknown_family_names_supported_ones():
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        vllm_param_for("blip2", "lm_head.weight")


# --- every tensor of a real (tiny) transformers model ------------------------------------------


@functools.lru_cache(maxsize=None)
def _tiny_model(family: str):
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2]})
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2))
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=32, fullatt_block_indexes=[1], window_size=56))
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    return model


def _tiny_state_dict(family: str) -> dict[str, torch.Tensor]:
    return _tiny_model(family).state_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_transformers_tensor_has_one_distinct_home(family):
    state = _tiny_state_dict(family)
    homes = {}
    for name, tensor in state.items():
        home = vllm_param_for(family, name)
        assert home not in homes, f"{name} and {homes.get(home)} both map to {home}"
        homes[home] = name
    # Stacked parameters get all their members, each member exactly once, and the members'
    # output rows add up to what one fused parameter holds.
    by_param: dict[str, list[tuple]] = {}
    for (param, shard), name in homes.items():
        if shard is not None:
            by_param.setdefault(param, []).append((shard, state[name].shape))
    assert by_param, "nothing was stacked"
    for param, parts in by_param.items():
        shards = sorted(parts, key=lambda p: str(p[0]))
        expected = ["k", "q", "v"] if param.rsplit(".", 2)[-2] == "qkv_proj" else [0, 1]
        assert [s for s, _ in shards] == expected, param
        assert len({shape[1:] for _, shape in parts}) == 1, param


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_names_map_like_the_model_in_memory(family, tmp_path):
    # save_pretrained writes the hub layout (model.*, visual.*), not the module names.
    _tiny_model(family).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    memory = list(_tiny_state_dict(family))
    assert len(saved) == len(memory)
    assert {vllm_param_for(family, n) for n in saved} == {vllm_param_for(family, n) for n in memory}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layers_stack_identically_across_families(family):
    names = [n for n in _tiny_state_dict(family) if n.startswith("model.language_model.")]
    stacked = {vllm_param_for(family, n) for n in names if vllm_param_for(family, n)[1] is not None}
    # Two layers x (q, k, v weights and biases + gate, up weights) = 2 x 8.
    assert len(stacked) == 16


# --- collapsing expanded image placeholders ----------------------------------------------------

PAD, START, END = 151655, 151652, 151653


def test_collapse_each_run_to_one_placeholder():
    ids = [1, 2, START] + [PAD] * 6 + [END, 3, START] + [PAD] * 4 + [END, 4]
    assert collapse_image_pads(ids, PAD) == [1, 2, START, PAD, END, 3, START, PAD, END, 4]


def test_collapse_leaves_other_tokens_and_single_pads():
    assert collapse_image_pads([5, PAD, 5, 5, PAD], PAD) == [5, PAD, 5, 5, PAD]
    assert collapse_image_pads([], PAD) == []
    assert collapse_image_pads([7, 7, 7], PAD) == [7, 7, 7]  # runs of other tokens are kept


def test_collapse_accepts_tensors_and_returns_python_ints():
    out = collapse_image_pads(torch.tensor([9, PAD, PAD, PAD, 9]), PAD)
    assert out == [9, PAD, 9] and all(type(t) is int for t in out)


def test_collapse_then_reexpand_round_trips():
    # What vLLM does to a collapsed prompt: each single placeholder becomes its image's run.
    runs = [6, 4, 9]
    ids = [0]
    for n in runs:
        ids += [START] + [PAD] * n + [END, 0]
    collapsed = collapse_image_pads(ids, PAD)
    assert collapsed.count(PAD) == len(runs)
    rebuilt, it = [], iter(runs)
    for t in collapsed:
        rebuilt += [PAD] * next(it) if t == PAD else [t]
    assert rebuilt == ids


# --- tensors vLLM builds no parameter for ----------------------------------------------------

from rollout.weight_names import VLLM_PENDING, VLLMSkips, vllm_load_name, vllm_names  # noqa: E402


def _llava_config(layers=4, feature_layer=-2):
    return {"vision_config": {"num_hidden_layers": layers}, "vision_feature_layer": feature_layer}


def test_llava_skips_the_vision_layers_past_the_feature_layer_and_post_layernorm():
    skips = VLLMSkips.for_config("llava", _llava_config())
    assert skips == VLLMSkips(vision_layers=3, post_layernorm=False)
    for name in ("model.vision_tower.vision_model.encoder.layers.3.self_attn.q_proj.weight",
                 "vision_tower.vision_model.encoder.layers.3.mlp.fc2.bias",  # hub layout
                 "model.vision_tower.vision_model.post_layernorm.weight"):
        assert skips.reason("llava", name) is not None, name
    for name in ("model.vision_tower.vision_model.encoder.layers.2.self_attn.q_proj.weight",
                 "model.vision_tower.vision_model.pre_layrnorm.weight",
                 "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
                 "model.language_model.layers.3.mlp.up_proj.weight",
                 "model.multi_modal_projector.linear_1.weight", "lm_head.weight"):
        assert skips.reason("llava", name) is None, name


def test_llava_feature_layer_rules_follow_vllm_get_layer_index():
    assert VLLMSkips.for_config("llava", _llava_config(4, -1)) == VLLMSkips(vision_layers=4, post_layernorm=True)
    assert VLLMSkips.for_config("llava", _llava_config(4, 2)).vision_layers == 2
    assert VLLMSkips.for_config("llava", _llava_config(24, [-2, -5, -8])).vision_layers == 23
    skips = VLLMSkips.for_config("llava", _llava_config(4, 2))
    assert skips.reason("llava", "model.vision_tower.vision_model.encoder.layers.2.layer_norm1.weight")
    assert skips.reason("llava", "model.vision_tower.vision_model.encoder.layers.1.layer_norm1.weight") is None


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_gemma3_and_smolvlm_keep_their_whole_tower_but_no_siglip_head(family):
    tower = {"gemma3": "model.vision_tower.vision_model.", "idefics3": "model.vision_model."}[family]
    skips = VLLMSkips.for_config(family, {"vision_config": {"num_hidden_layers": 2}})
    assert skips == VLLMSkips()
    assert skips.reason(family, f"{tower}encoder.layers.1.self_attn.k_proj.weight") is None
    assert skips.reason(family, f"{tower}post_layernorm.weight") is None
    assert "head" in skips.reason(family, f"{tower}head.attention.in_proj_weight")


def test_qwen_families_skip_nothing():
    skips = VLLMSkips.for_config("qwen2_5_vl", {"vision_config": {}})
    assert skips.reason("qwen2_5_vl", "model.visual.merger.mlp.0.weight") is None
    assert skips.reason("qwen2_5_vl", "model.visual.blocks.31.attn.qkv.weight") is None


def test_smolvlm_embedding_name_maps_to_the_vllm_text_model():
    assert vllm_param_for("idefics3", vllm_names("idefics3").embed_tokens) == ("model.text_model.embed_tokens.weight", None)
    assert vllm_param_for("idefics3", "lm_head.weight") == ("lm_head.weight", None)


def test_no_family_with_a_name_table_is_pending():
    assert VLLM_PENDING == {}


def test_tiny_llava_checkpoint_skips_exactly_its_last_vision_layer_and_post_layernorm(tmp_path):
    import json

    from safetensors import safe_open

    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path / "llava", family="llava", size="tiny", seed=0)
    config = json.loads((folder / "config.json").read_text())
    last = config["vision_config"]["num_hidden_layers"] - 1
    names = []
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            names += list(handle.keys())
    skips = VLLMSkips.for_config("llava", config)
    skipped = {n for n in names if skips.reason("llava", n)}
    assert skipped and all(f"encoder.layers.{last}." in n or "post_layernorm" in n for n in skipped)
    assert {n for n in names if f"encoder.layers.{last}." in n or "post_layernorm." in n} == skipped


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_clip_and_siglip_towers_get_vllm_vision_model_level(family):
    """transformers 5 names the tower without `vision_model.`; vLLM 0.26 keeps that level."""
    for name in ("model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",  # in memory
                 "vision_tower.encoder.layers.0.self_attn.q_proj.weight",  # file, transformers 5
                 "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"):  # hub, older
        assert vllm_param_for(family, name) == ("vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight", "q")
    assert vllm_param_for(family, "model.vision_tower.post_layernorm.bias") == (
        "vision_tower.vision_model.post_layernorm.bias", None)
    # What refit hands to vLLM's own loader, whose mapper only moves the `model.` prefix.
    assert vllm_load_name(family, "model.vision_tower.embeddings.patch_embedding.weight") == (
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight")
    assert vllm_load_name(family, "vision_tower.vision_model.embeddings.patch_embedding.weight") == (
        "vision_tower.vision_model.embeddings.patch_embedding.weight")
    assert vllm_load_name(family, "model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.language_model.layers.0.mlp.up_proj.weight")


def test_smolvlm_and_qwen_load_names_are_the_transformers_names():
    for family, name in (("idefics3", "model.vision_model.encoder.layers.0.self_attn.q_proj.weight"),
                         ("qwen2_5_vl", "model.visual.blocks.0.attn.qkv.weight")):
        assert vllm_load_name(family, name) == name


def test_an_unknown_family_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown family 'blip2'.*qwen2_5_vl"):
        vllm_param_for("blip2", "lm_head.weight")
