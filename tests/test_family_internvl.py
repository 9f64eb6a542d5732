"""InternVL3 on a tiny checkpoint: what is particular to it beyond tests/test_families.py.

Its tiles must be the ones vLLM counts (`get_number_of_image_patches`, which vLLM 0.26's InternS1
processor calls), its image features transformers' own (`InternVLModel.get_image_features`), its
weight names vLLM's (`InternS1ForConditionalGeneration.hf_to_vllm_mapper`), and its prompts
collapse to one `<IMG_CONTEXT>` per image, which vLLM's processor replaces with `<img>` + run + `</img>`.
"""

import pytest
import torch
from PIL import Image

from data.datasets import Sample
from data.processing import encode_prompt, load_processor
from data.prompts import build_messages
from rollout.weight_names import vllm_param_for


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    from transformers import AutoConfig

    from models.family import build_adapter
    from tools.make_tiny_model import main

    folder = tmp_path_factory.mktemp("internvl") / "tiny"
    main(["--family", "internvl", "--size", "tiny", "--out", str(folder)])
    processor = load_processor(str(folder))
    return folder, processor, build_adapter(AutoConfig.from_pretrained(str(folder), local_files_only=True))


def _sample(sizes):
    images = [Image.new("RGB", s, (40 * i, 200, 30)) for i, s in enumerate(sizes)]
    return Sample(0, images, " and ".join(["<image>"] * len(images)) + " How many objects?", "3")


@pytest.mark.parametrize("size, grid", [((56, 56), [1, 1, 1]), ((84, 56), [3, 1, 2]), ((100, 60), [3, 1, 2]),
                                        ((112, 112), [5, 2, 2]), ((40, 150), [5, 4, 1])])
def test_tiles_are_the_ones_vllm_counts(internvl, size, grid):
    _, processor, adapter = internvl
    image = processor.prepare_images([Image.new("RGB", size, (200, 30, 30))])[0]
    assert image.size == (grid[2] * 56, grid[1] * 56) and processor.prepare_images([image])[0].size == image.size
    pixels, grids = processor.images.encode([image])
    assert grids.tolist() == [grid] and pixels.shape[0] == adapter.pixel_rows(grids) == grid[0]
    kwargs = adapter.vllm_processor_kwargs(0, 0)
    assert processor.image_processor.get_number_of_image_patches(image.height, image.width, kwargs) == grid[0]


def test_image_features_are_the_models_own(internvl):
    from transformers import AutoModelForImageTextToText

    folder, processor, adapter = internvl
    model = AutoModelForImageTextToText.from_pretrained(str(folder), local_files_only=True).eval()
    prompt = encode_prompt(processor, _sample([(84, 56), (56, 56)]), "clevr", 4096)
    with torch.no_grad():
        ours = adapter.image_features(model, prompt.pixel_values, prompt.image_grid_thw)[0]
        theirs = model.model.get_image_features(pixel_values=prompt.pixel_values).pooler_output.flatten(0, 1)
    assert ours.shape[0] == sum(adapter.image_token_count(g) for g in prompt.image_grid_thw)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("hf_name, vllm_name, shard", [
    ("model.language_model.layers.1.self_attn.k_proj.weight", "language_model.model.layers.1.self_attn.qkv_proj.weight", "k"),
    ("language_model.model.layers.0.mlp.up_proj.weight", "language_model.model.layers.0.mlp.gate_up_proj.weight", 1),
    ("lm_head.weight", "language_model.lm_head.weight", None),
    ("language_model.lm_head.weight", "language_model.lm_head.weight", None),
    ("model.vision_tower.encoder.layer.0.attention.q_proj.weight", "vision_tower.encoder.layer.0.attention.q_proj.weight", None),
    ("vision_tower.encoder.layer.1.lambda_1", "vision_tower.encoder.layer.1.lambda_1", None),
    ("vision_tower.embeddings.cls_token", "vision_tower.embeddings.cls_token", None),
    ("model.multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.weight", None),
    ("multi_modal_projector.layer_norm.bias", "multi_modal_projector.layer_norm.bias", None),
])
def test_vllm_names(hf_name, vllm_name, shard):
    assert vllm_param_for("internvl", hf_name) == (vllm_name, shard)


def test_prompts_collapse_to_what_vllm_expands(internvl):
    _, processor, adapter = internvl
    vocab = processor.tokenizer.get_vocab()
    sample = _sample([(84, 56), (56, 56)])
    prompt = encode_prompt(processor, sample, "clevr", 4096)
    ours = prompt.input_ids.tolist()
    collapsed, blocks = adapter.vllm_collapse(ours, vocab)
    text = processor.apply_chat_template(build_messages(sample, "clevr"))
    assert collapsed == processor.tokenizer.encode(text, add_special_tokens=False)
    # vLLM 0.26 (interns1.py): <img> + <IMG_CONTEXT> × num_patches · image_seq_length + </img>.
    seq = processor.images.seq_len
    assert blocks == [[vocab["<img>"], *[adapter.image_token_id] * (int(g[0]) * seq), vocab["</img>"]]
                      for g in prompt.image_grid_thw]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ours
    with pytest.raises(ValueError, match="not closed"):
        adapter.vllm_collapse(ours[: ours.index(vocab["</img>"])], vocab)


def test_tokenizer_names_the_tokens_internvl_processor_reads(internvl):
    _, processor, adapter = internvl
    tok = processor.tokenizer
    assert tok.context_image_token_id == adapter.image_token_id
    assert (tok.start_image_token, tok.end_image_token, tok.video_token) == ("<img>", "</img>", "<video>")
