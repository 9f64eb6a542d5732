"""vLLM prompt forms per family: the trainer's expanded ids collapse to what vLLM 0.26 expands, and back.

vLLM is not installed here. Each family's replacement rule below is written from vLLM 0.26's own
processor for it (the ids it inserts for one image), and the collapsed prompt is compared with the
tokenization of the chat text before expansion, which is what vLLM would build from text itself.
"""

from __future__ import annotations

import pytest
from PIL import Image

from data.datasets import Sample
from data.processing import encode_prompt, load_processor
from data.prompts import build_messages

FAMILIES = ["qwen2_5_vl", "llava", "idefics3", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from transformers import AutoConfig

    from models.family import build_adapter
    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("vllm_prompts") / request.param, family=request.param,
                             size="tiny", seed=0)
    processor = load_processor(str(folder))
    adapter = build_adapter(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    return request.param, processor, adapter, processor.tokenizer.get_vocab()


def _images(count: int) -> list[Image.Image]:
    # Different shapes, so SmolVLM splits them into different tile grids.
    sizes = [(84, 56), (56, 112), (56, 56)]
    return [Image.new("RGB", sizes[i], (40 * i, 200, 30)) for i in range(count)]


def _sample(count: int) -> Sample:
    tags = " and ".join(["<image>"] * count)
    return Sample(0, _images(count), f"{tags} How many objects?", "3")


def _vllm_replacement(name, processor, adapter, grid_row, image) -> list[int]:
    """The ids vLLM 0.26 inserts for one image, by its own rule for the family."""
    tok = processor.tokenizer
    if name == "qwen2_5_vl":  # qwen2_vl.py: <|image_pad|> × grid_thw.prod() // merge²
        return [adapter.image_token_id] * (int(grid_row.prod()) // adapter.spatial_merge_size**2)
    if name == "llava":  # llava.py: CLIP patches + CLS, minus CLS under the "default" strategy
        return [adapter.image_token_id] * ((adapter.image_size // adapter.patch_size) ** 2 + 1 - 1)
    if name == "idefics3":  # idefics3.py get_image_repl, grid from the image processor with the kwargs
        kwargs = adapter.vllm_processor_kwargs(0, 0)
        _, rows, cols = processor.image_processor.get_number_of_image_patches(image.height, image.width, kwargs)
        run = "<image>" * processor.images.seq_len
        glob = "<fake_token_around_image><global-img>" + run
        if rows == 0 and cols == 0:
            text = glob + "<fake_token_around_image>"
        else:
            tiles = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{run}" for c in range(cols))
                            + "\n" for r in range(rows))
            text = tiles + "\n" + glob + "<fake_token_around_image>"
        return tok.encode(text, add_special_tokens=False)
    if name == "gemma3":  # gemma3_mm.py: full_image_sequence, no pan-and-scan crops
        assert adapter.vllm_processor_kwargs(0, 0)["do_pan_and_scan"] is False
        k = processor.images.tokens
        return tok.encode("\n\n<start_of_image>" + "<image_soft_token>" * k + "<end_of_image>\n\n",
                          add_special_tokens=False)
    raise AssertionError(name)


@pytest.mark.parametrize("count", [1, 2])
def test_collapse_gives_the_prompt_vllm_expands_and_back(family, count):
    name, processor, adapter, vocab = family
    sample = _sample(count)
    encoded = encode_prompt(processor, sample, "clevr", 4096)
    ids = encoded.input_ids.tolist()

    collapsed, blocks = adapter.vllm_collapse(ids, vocab)

    # The un-expanded form: the chat text with one placeholder per image, tokenized as it stands.
    text = processor.apply_chat_template(build_messages(sample, "clevr"))
    assert collapsed == processor.tokenizer.encode(text, add_special_tokens=False)
    assert collapsed.count(adapter.vllm_target(vocab)) == count
    assert len(collapsed) < len(ids)

    # vLLM's replacement for each image, spliced in by its rule, gives the trainer's ids exactly.
    expected = [_vllm_replacement(name, processor, adapter, g, im) for g, im in zip(encoded.image_grid_thw, encoded.images)]
    assert blocks == expected
    assert adapter.vllm_expand(collapsed, expected, vocab) == ids


def test_idefics3_collapse_removes_the_framing(family):
    name, processor, adapter, vocab = family
    if name != "idefics3":
        pytest.skip("SmolVLM only")
    ids = encode_prompt(processor, _sample(1), "clevr", 4096).input_ids.tolist()
    collapsed, _ = adapter.vllm_collapse(ids, vocab)
    for token in ("<fake_token_around_image>", "<global-img>", "<row_1_col_1>", "<row_2_col_2>"):
        assert vocab[token] in ids and vocab[token] not in collapsed
    assert collapsed.count(vocab["<image>"]) == 1


def test_gemma3_newlines_merge_as_vllm_merges_them(family):
    name, processor, adapter, vocab = family
    if name != "gemma3":
        pytest.skip("Gemma3 only")
    nl = {k: vocab["\n" * k] for k in (1, 2, 3, 4)}
    boi, eoi = adapter.extra_banned_ids
    soft = [adapter.image_token_id] * adapter.tokens_per_image
    block = [nl[2], boi, *soft, eoi, nl[2]]
    text_a, text_b = processor.tokenizer.encode("user", add_special_tokens=False)[0], 5
    # "user\n" + block + "\nx": the tokenizer writes \n\n\n on both sides.
    ids = [text_a, nl[3], boi, *soft, eoi, nl[3], text_b]
    collapsed, blocks = adapter.vllm_collapse(ids, vocab)
    assert collapsed == [text_a, nl[1], boi, nl[1], text_b]
    assert blocks == [block]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ids
    # "\n\n" of text on both sides: \n\n\n\n, text keeps its own \n\n.
    ids = [text_a, nl[4], boi, *soft, eoi, nl[4], text_b]
    collapsed, blocks = adapter.vllm_collapse(ids, vocab)
    assert collapsed == [text_a, nl[2], boi, nl[2], text_b]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ids
    # Two images back to back share one \n\n\n\n.
    ids = [text_a, nl[2], boi, *soft, eoi, nl[4], boi, *soft, eoi, nl[2], text_b]
    collapsed, blocks = adapter.vllm_collapse(ids, vocab)
    assert collapsed == [text_a, boi, boi, text_b]
    assert adapter.vllm_expand(collapsed, blocks, vocab) == ids
    # A block without the processor's newlines is not a Gemma3 prompt.
    with pytest.raises(ValueError, match="newline"):
        adapter.vllm_collapse([text_a, boi, *soft, eoi, nl[2], text_b], vocab)
    with pytest.raises(ValueError, match="soft tokens"):
        adapter.vllm_collapse([text_a, nl[2], boi, *soft[1:], eoi, nl[2], text_b], vocab)


def test_llava_adjacent_images_split_by_their_fixed_count(family):
    name, processor, adapter, vocab = family
    if name != "llava":
        pytest.skip("LLaVA only")
    per_image = (adapter.image_size // adapter.patch_size) ** 2
    img = adapter.image_token_id
    collapsed, blocks = adapter.vllm_collapse([1, *[img] * (2 * per_image), 2], vocab)
    assert collapsed == [1, img, img, 2]
    assert blocks == [[img] * per_image] * 2
    with pytest.raises(ValueError, match="multiple of"):
        adapter.vllm_collapse([1, *[img] * (per_image + 1), 2], vocab)


def test_processor_kwargs_size_vllm_replacement_like_the_trainer(family):
    """The kwargs vLLM gets make its replacement as long as the trainer's image block."""
    name, processor, adapter, vocab = family
    encoded = encode_prompt(processor, _sample(2), "clevr", 4096)
    for grid, image in zip(encoded.image_grid_thw, encoded.images):
        repl = _vllm_replacement(name, processor, adapter, grid, image)
        assert repl.count(adapter.image_token_id) == adapter.image_token_count(grid)
    kwargs = adapter.vllm_processor_kwargs(3136, 12544)
    expected = {
        "qwen2_5_vl": {"size": {"shortest_edge": 3136, "longest_edge": 12544}, "do_resize": False},
        "llava": {},
        "idefics3": {"do_image_splitting": True},
        "gemma3": {"do_pan_and_scan": False},
    }[name]
    assert kwargs == expected


def test_vllm_processor_kwargs_reproduce_the_trainer_pixels(family):
    """vLLM runs the family's image processor itself, on the trainer's images, with the adapter's kwargs:
    the pixel values must come out bitwise equal to the ones the policy trains on."""
    import torch

    name, processor, adapter, _ = family
    encoded = encode_prompt(processor, _sample(2), "clevr", 4096)
    kwargs = adapter.vllm_processor_kwargs(3136, 12544)
    images = [encoded.images] if name == "idefics3" else encoded.images  # Idefics3 takes images per sample
    out = processor.image_processor(images=images, return_tensors="pt", **kwargs)
    engine_side = out["pixel_values"].reshape(-1)
    assert engine_side.shape == encoded.pixel_values.reshape(-1).shape
    assert torch.equal(engine_side, encoded.pixel_values.reshape(-1).to(engine_side.dtype))


def test_gemma3_tokenizer_names_its_image_tokens(family):
    """Gemma3Processor (so vLLM's Gemma3 processor) reads the image tokens off the tokenizer by name:
    without them it fails before any prompt ("Qwen2Tokenizer has no attribute boi_token_id")."""
    name, processor, adapter, _ = family
    if name != "gemma3":
        pytest.skip("Gemma3 only")
    tok = processor.tokenizer
    assert (tok.boi_token, tok.eoi_token, tok.image_token) == ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    assert [tok.boi_token_id, tok.eoi_token_id] == list(adapter.extra_banned_ids[:2])
    assert tok.image_token_id == adapter.image_token_id
