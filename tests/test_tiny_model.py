"""Tests of tools/make_tiny_model.py: the tiny checkpoints load, tokenize and run like hub ones."""

import os

# Before transformers is imported: nothing here may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)

from tools.make_tiny_model import SIZES, SPECIAL_TOKENS, main, make_tiny_model  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# transformers' Qwen2-VL processors build a video processor, which needs torchvision.
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
LOCAL = {"local_files_only": True}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny checkpoint per family, seed 0, shared by the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root / family, family=family, size="tiny", seed=0) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(built):
    """Tokenizer, image processor and model of each family, loaded through the Auto classes."""
    out = {}
    for family, folder in built.items():
        out[family] = (
            AutoTokenizer.from_pretrained(folder, **LOCAL),
            AutoImageProcessor.from_pretrained(folder, **LOCAL),
            AutoModelForImageTextToText.from_pretrained(folder, **LOCAL).eval(),
        )
    return out


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in the folder, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _image_message(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _forward(model, input_ids, pixel_values, image_grid_thw):
    """Forward with m-rope inputs: transformers 5.2x takes the image-token mask as mm_token_type_ids."""
    kwargs = {"input_ids": input_ids, "pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        return model(**kwargs).logits


def test_folder_has_hub_files(built):
    for folder in built.values():
        names = {p.name for p in folder.iterdir()}
        assert {
            "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json", "processor_config.json",
        } <= names
        assert not any(n.startswith(".") for n in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_the_family_config(built, loaded, family):
    tokenizer, _, model = loaded[family]
    config = AutoConfig.from_pretrained(built[family], **LOCAL)
    expected = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
    assert config.model_type == family
    assert config.architectures == [expected[family]]
    assert type(model).__name__ == expected[family]
    assert config.tie_word_embeddings is False
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) * 2 == head_dim
    assert text.vocab_size % 64 == 0 and len(tokenizer) <= text.vocab_size < len(tokenizer) + 64
    assert model.get_input_embeddings().weight.shape[0] == text.vocab_size
    if family == "qwen2_5_vl":
        vision = config.vision_config
        assert all(0 <= i < vision.depth for i in vision.fullatt_block_indexes)
        assert vision.window_size % (vision.patch_size * vision.spatial_merge_size) == 0
        assert vision.out_hidden_size == text.hidden_size


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_are_single_ids_that_the_config_uses(built, loaded, family):
    tokenizer, _, model = loaded[family]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    bpe = SIZES["tiny"].bpe_vocab
    assert ids == list(range(bpe, bpe + len(SPECIAL_TOKENS)))
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    by_name = dict(zip(SPECIAL_TOKENS, ids))
    config = model.config
    assert config.image_token_id == by_name["<|image_pad|>"]
    assert config.video_token_id == by_name["<|video_pad|>"]
    assert config.vision_start_token_id == by_name["<|vision_start|>"]
    assert config.vision_end_token_id == by_name["<|vision_end|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    generation = GenerationConfig.from_pretrained(built[family], **LOCAL)
    assert generation.eos_token_id == [by_name["<|im_end|>"], by_name["<|endoftext|>"]]
    assert generation.pad_token_id == by_name["<|endoftext|>"]


ROUND_TRIP = [
    "0 1 2 3 4 5 6 7 8 9 10 99 100 512 1000 3.14 -7 0.05",
    "\\frac{7}{2}",
    "2\\sqrt{3}",
    "60° and 60^\\circ and 4\\pi",
    "<think> There are 3 red cubes. </think> <answer>3</answer>",
    "\\boxed{}",
    "\\boxed{\\frac{\\sqrt{2}}{2}}",
    "naïve café ∠ABC ≈ 45°, π ≤ 4, 三角形, emoji 🙂",
    "line one\nline two\n\n  indented\ttab\r\nend ",
    "How many red cubes are there?",
    "Find the area of the circle. Round to the nearest tenth.",
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips_exactly(loaded, text):
    for tokenizer, _, _ in loaded.values():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_learned_the_corpus(loaded):
    tokenizer = loaded["qwen2_5_vl"][0]
    # Trained merges: frequent corpus words and tags are far shorter than their bytes.
    for text in ("How many red cubes are there?", "<think>", "</answer>", "\\frac"):
        assert len(tokenizer.encode(text, add_special_tokens=False)) <= len(text.encode()) // 2


def test_chat_template_matches_the_family_format(loaded):
    tokenizer = loaded["qwen2_vl"][0]
    messages = _image_message("How many red cubes are there?")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many red cubes are there?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]},
        {"role": "assistant", "content": "<answer>yes</answer>"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_vision_id=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Picture 2: <|vision_start|><|image_pad|><|vision_end|>Same?<|im_end|>\n"
        "<|im_start|>assistant\n<answer>yes</answer><|im_end|>\n"
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", [56, 112])
def test_image_prompt_expands_and_runs(loaded, family, side):
    tokenizer, image_processor, model = loaded[family]
    text = tokenizer.apply_chat_template(_image_message("How many red cubes are there?"), tokenize=False,
                                         add_generation_prompt=True)
    pixels = image_processor(images=[Image.new("RGB", (side, side), (200, 30, 30))], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    assert grid.tolist() == [[1, side // 14, side // 14]]
    merge = image_processor.merge_size
    n_tokens = int(grid.prod()) // merge**2
    input_ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens), return_tensors="pt")["input_ids"]
    assert int((input_ids == model.config.image_token_id).sum()) == n_tokens
    logits = _forward(model, input_ids, pixels["pixel_values"], grid)
    assert logits.shape == (1, input_ids.shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_pixel_limits_follow_the_size(loaded):
    image_processor = loaded["qwen2_5_vl"][1]
    big = image_processor(images=[Image.new("RGB", (640, 480))], return_tensors="pt")["image_grid_thw"]
    small = image_processor(images=[Image.new("RGB", (8, 8))], return_tensors="pt")["image_grid_thw"]
    tiny = SIZES["tiny"]
    assert int(big.prod()) * 14 * 14 <= tiny.max_pixels
    assert int(small.prod()) * 14 * 14 >= tiny.min_pixels


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' Qwen2-VL processors need torchvision")
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_processor_loads_and_expands_image_tokens(built, loaded, family):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built[family], **LOCAL)
    expected = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
    assert type(processor).__name__ == expected[family]
    image = Image.new("RGB", (56, 56), (20, 200, 30))
    text = processor.apply_chat_template(_image_message("Find x."), tokenize=False, add_generation_prompt=True)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    grid = batch["image_grid_thw"]
    merge = processor.image_processor.merge_size
    model = loaded[family][2]
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == int(grid.prod()) // merge**2
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], model.config.text_config.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_names_are_the_hub_names(built, loaded, family):
    with safe_open(str(built[family] / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    prefixes = ("model.embed_tokens.", "model.layers.", "model.norm.", "visual.", "lm_head.")
    assert all(k.startswith(prefixes) for k in keys), [k for k in keys if not k.startswith(prefixes)]
    for prefix in prefixes:
        assert any(k.startswith(prefix) for k in keys), prefix
    # Loaded, the same tensors live under transformers' module names.
    model = loaded[family][2]
    loaded_names = set(model.state_dict())
    assert len(loaded_names) == len(keys)
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in loaded_names)


def test_current_weight_names_load_to_the_same_model(built, loaded, tmp_path):
    folder = make_tiny_model(tmp_path / "current", family="qwen2_vl", size="tiny", seed=0, weight_names="current")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in keys} == {
        "model.language_model", "model.visual", "lm_head.weight"
    }
    reference = loaded["qwen2_vl"][2].state_dict()
    reloaded = AutoModelForImageTextToText.from_pretrained(folder, **LOCAL).state_dict()
    assert reloaded.keys() == reference.keys()
    assert all(torch.equal(reloaded[k], reference[k]) for k in reference)


def test_same_seed_gives_identical_files(built, tmp_path):
    again = make_tiny_model(tmp_path / "again", family="qwen2_5_vl", size="tiny", seed=0)
    assert _digests(again) == _digests(built["qwen2_5_vl"])


def test_other_seed_changes_only_the_weights(built, tmp_path, capsys):
    folder = tmp_path / "seed1"
    main(["--family", "qwen2_5_vl", "--size", "tiny", "--out", str(folder), "--seed", "1"])
    summary = capsys.readouterr().out
    assert "params" in summary and "qwen2_5_vl/tiny" in summary
    first, second = _digests(built["qwen2_5_vl"]), _digests(folder)
    assert first.keys() == second.keys()
    assert first["model.safetensors"] != second["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "preprocessor_config.json"):
        assert first[name] == second[name], name


def test_bad_arguments_fail_with_clear_errors(built, tmp_path):
    with pytest.raises(ValueError, match="unknown family 'blip2'"):
        make_tiny_model(tmp_path / "x", family="blip2")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        make_tiny_model(tmp_path / "x", size="huge")
    with pytest.raises(FileExistsError, match="already exists"):
        make_tiny_model(built["qwen2_vl"], family="qwen2_vl")


def test_processor_config_names_the_family_processor(built):
    for family, folder in built.items():
        nested = json.loads((folder / "processor_config.json").read_text())
        flat = json.loads((folder / "preprocessor_config.json").read_text())
        assert nested["processor_class"] == flat["processor_class"]
        assert nested["processor_class"] == {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[family]
        assert nested["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
        flat.pop("processor_class")
        assert nested["image_processor"] == flat
        assert flat["patch_size"] == 14 and flat["merge_size"] == 2 and flat["temporal_patch_size"] == 2


def test_qwen3_5_4b_size_has_the_released_shapes():
    """The benchmark size builds Qwen3.5-4B's config (checked on the meta device: no weights drawn),
    and other families refuse it."""
    import transformers

    from tools.make_tiny_model import FAMILIES, SIZES, _check_size, build_config, build_tokenizer

    size = SIZES["qwen3_5_4b"]
    with pytest.raises(ValueError, match="qwen3_5"):
        _check_size(size, "qwen2_5_vl")
    _check_size(size, "qwen3_5")
    config = build_config("qwen3_5", size, build_tokenizer(FAMILIES["qwen3_5"], size))
    t = config.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.head_dim, t.linear_num_value_heads, t.vocab_size) == (
        2560, 32, 256, 32, 248320)
    assert t.layer_types.count("full_attention") == 8 and config.tie_word_embeddings
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    assert 4.4e9 < sum(p.numel() for p in model.parameters()) < 4.7e9


def test_tiny_hd128_variants_each_add_one_feature_of_the_3b_size():
    """The exact mode's bisecting sizes: tiny_hd128 with one 3b feature each (configs only, no weights drawn)."""
    from tools.make_tiny_model import FAMILIES, SIZES, _check_size, build_config, build_tokenizer

    base = SIZES["tiny_hd128"]
    tokenizer = build_tokenizer(FAMILIES["qwen2_5_vl"], base)
    configs = {}
    for name in ("tiny_hd128_vit3b", "tiny_hd128_gqa8", "tiny_hd128_mlp", "tiny_hd128_vocab", "tiny_hd128_deep"):
        _check_size(SIZES[name], "qwen2_5_vl")
        configs[name] = build_config("qwen2_5_vl", SIZES[name], tokenizer)
    for config in configs.values():  # the language model's heads stay 128 wide (the exact mode's H200 rule)
        t = config.text_config
        assert t.hidden_size // t.num_attention_heads == 128
    vit = configs["tiny_hd128_vit3b"].vision_config
    assert (vit.hidden_size // vit.num_heads, vit.intermediate_size, vit.window_size) == (80, 3420, 112)
    gqa = configs["tiny_hd128_gqa8"].text_config
    assert gqa.num_attention_heads // gqa.num_key_value_heads == 8
    assert configs["tiny_hd128_mlp"].text_config.intermediate_size == 11008
    assert configs["tiny_hd128_vocab"].text_config.vocab_size == 151936
    deep = configs["tiny_hd128_deep"]
    assert deep.text_config.num_hidden_layers == 36 and deep.vision_config.depth == 32
    assert list(deep.vision_config.fullatt_block_indexes) == [7, 15, 23, 31]


def test_no_weights_writes_the_size_s_config_and_processor_only(tmp_path, capsys):
    """--no-weights: the 3b size's config, tokenizer and processor without building its 3.75B parameters
    (what vLLM's processor reads on the CPU); its images expand to the 3b size's token counts."""
    from data.processing import load_processor

    out = tmp_path / "q3b"
    main(["--family", "qwen2_5_vl", "--size", "3b", "--out", str(out), "--no-weights"])
    assert "no weights" in capsys.readouterr().out
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == SIZES["3b"].text_hidden
    assert config["vision_config"]["depth"] == SIZES["3b"].vision_depth
    processor = load_processor(str(out))
    image = processor.prepare_images([Image.new("RGB", (448, 448), "red")])
    grid = processor(processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}]),
                     image)["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32]]  # 448 / 14 patches a side: 256 image tokens after the 2x2 merge
