"""GLM-4.1V on a tiny checkpoint: what is particular to it beyond tests/test_families.py.

Its position ids must be the model's own (`Glm4vModel.get_rope_index`), its weight names vLLM
0.26's (`Glm4vForConditionalGeneration.hf_to_vllm_mapper` and its tower's stacking), and its
prompts collapse to one `<|image|>` per image, which vLLM's processor replaces with the run.
"""

import pytest
import torch
from PIL import Image

from data.datasets import Sample
from data.processing import encode_prompt, load_processor
from data.prompts import build_messages
from rollout.weight_names import vllm_param_for


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory):
    from transformers import AutoConfig

    from models.family import build_adapter
    from tools.make_tiny_model import main

    folder = tmp_path_factory.mktemp("glm4v") / "tiny"
    main(["--family", "glm4v", "--size", "tiny", "--out", str(folder)])
    processor = load_processor(str(folder))
    return folder, processor, build_adapter(AutoConfig.from_pretrained(str(folder), local_files_only=True))


def _sample(sizes):
    images = [Image.new("RGB", s, (40 * i, 200, 30)) for i, s in enumerate(sizes)]
    tags = " and ".join(["<image>"] * len(images))
    return Sample(0, images, f"{tags} How many objects?", "3")


def _prompt(processor, sizes):
    return encode_prompt(processor, _sample(sizes), "clevr", 4096)


def test_positions_are_the_models_own(glm4v):
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder, processor, adapter = glm4v
    prompt = _prompt(processor, [(84, 56), (56, 112)])
    ids = prompt.input_ids
    ours = adapter.position_ids(ids, prompt.image_grid_thw)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(folder)))
    types = (ids == adapter.image_token_id).int().unsqueeze(0)
    theirs, _ = model.model.get_rope_index(ids.unsqueeze(0), types, prompt.image_grid_thw)
    assert ours.shape == (4, ids.numel())
    assert torch.equal(ours[1:], theirs[:, 0].cpu()) and torch.equal(ours[0], torch.arange(ids.numel()))
    assert adapter.next_rope_position(ours) == int(theirs.max()) + 1


def test_template_and_banned_tokens(glm4v):
    _, processor, adapter = glm4v
    vocab = processor.tokenizer.get_vocab()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])
    assert "<|begin_of_image|><|image|><|end_of_image|>x<|user|>" in text
    banned = {vocab[t] for t in ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
                                 "<|begin_of_video|>", "<|end_of_video|>")}
    assert set(adapter.banned_token_ids) == banned
    assert adapter.end_of_turn == "<|user|>" and adapter.tp_plan() == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise"}


@pytest.mark.parametrize("hf_name, vllm_name, shard", [
    ("model.language_model.layers.1.self_attn.k_proj.bias", "language_model.model.layers.1.self_attn.qkv_proj.bias", "k"),
    ("model.language_model.layers.0.mlp.gate_up_proj.weight", "language_model.model.layers.0.mlp.gate_up_proj.weight", None),
    ("model.language_model.layers.0.post_mlp_layernorm.weight", "language_model.model.layers.0.post_mlp_layernorm.weight", None),
    ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight", None),
    ("lm_head.weight", "language_model.lm_head.weight", None),
    ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight", None),
    ("model.visual.blocks.1.mlp.up_proj.weight", "visual.blocks.1.mlp.gate_up_proj.weight", 1),
    ("model.visual.merger.gate_proj.weight", "visual.merger.gate_up_proj.weight", 0),
    ("model.visual.merger.down_proj.weight", "visual.merger.down_proj.weight", None),
    ("model.visual.downsample.weight", "visual.downsample.weight", None),
    ("model.visual.embeddings.position_embedding.weight", "visual.embeddings.position_embedding.weight", None),
])
def test_vllm_names(hf_name, vllm_name, shard):
    assert vllm_param_for("glm4v", hf_name) == (vllm_name, shard)


def test_prompts_collapse_to_what_vllm_expands(glm4v):
    _, processor, adapter = glm4v
    vocab = processor.tokenizer.get_vocab()
    prompt = _prompt(processor, [(84, 56), (56, 56)])
    ours = prompt.input_ids.tolist()
    collapsed, blocks = adapter.vllm_collapse(ours, vocab)
    # What vLLM 0.26 would tokenize from the chat text, and its replacement: <|image|> × grid.prod() // merge².
    text = processor.apply_chat_template(build_messages(_sample([(84, 56), (56, 56)]), "clevr"))
    assert collapsed == processor.tokenizer.encode(text, add_special_tokens=False)
    assert collapsed.count(adapter.image_token_id) == 2
    assert blocks == [[adapter.image_token_id] * (int(g.prod()) // 4) for g in prompt.image_grid_thw]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ours
    assert adapter.vllm_processor_kwargs(3136, 12544) == {
        "size": {"shortest_edge": 3136, "longest_edge": 12544}, "do_resize": False}


def test_auto_runs_glm4v_on_vllm(monkeypatch):
    """Measured on an H200 (token_mult_prob_error max 1.0042 <= 1.01): auto picks vLLM, without a warning."""
    import warnings

    from rollout import factory

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    assert "glm4v" not in factory.VLLM_UNVERIFIED
    assert factory.resolve_engine_name("auto", "glm4v") == "vllm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert factory.resolve_engine_name("vllm", "glm4v") == "vllm"
