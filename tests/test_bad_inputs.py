"""A corpus of bad inputs, built here with PIL and raw bytes: each gets its documented behaviour.

Dataset rows are either converted (odd image modes, a 1×1 image) or skipped with a counted
reason (data/datasets.py, data/images.py, data/processing.py); a PromptFeeder run over one
parquet file holding all of them, mixed with good rows, finishes with the right counts. Rewards
never raise on parser-breaking LaTeX, and an image token inside a response is plain text to the
reward and never sampled by the engine.
"""

from __future__ import annotations

import io
import json
import math
import struct
import time
import zlib
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from data.datasets import SkipStats, VLDataset
from data.images import BadSample
from data.loader import PromptFeeder
from data.processing import encode_prompt, load_processor
from data.rewards import score

MIN_PIXELS, MAX_PIXELS = 3136, 12544
MAX_PROMPT_TOKENS = 512
Q = "How many objects are there? <image>"


# --- building bad images -------------------------------------------------------------------------
def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def gradient(size=(40, 30)) -> Image.Image:
    w, h = size
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
    arr[..., 2] = 90
    return Image.fromarray(arr, mode="RGB")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def header_only_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width×height RGB pixels, with almost no pixel data behind it."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")


def rgba_half_transparent() -> Image.Image:
    img = Image.new("RGBA", (40, 40), (200, 0, 0, 255))
    img.paste((0, 0, 255, 0), (0, 0, 20, 40))  # left half fully transparent blue
    return img


def palette_with_transparency() -> Image.Image:
    img = gradient().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    img.info["transparency"] = 0
    return img


def sixteen_bit() -> Image.Image:
    return Image.fromarray(np.arange(40 * 30, dtype=np.uint16).reshape(30, 40) * 50)  # mode I;16


GOOD = encode(gradient())

# (name, images, problem, answer, expected): expected is a skip reason, or "ok"
CORPUS = [
    ("good", [GOOD], Q, "3", "ok"),
    ("truncated_png", [GOOD[:60]], Q, "3", "corrupt_image"),
    ("non_image_bytes", [b"%PDF-1.4 this is a document, not a picture"], Q, "3", "not_an_image"),
    ("empty_bytes", [b""], Q, "3", "missing_image"),
    ("one_pixel", [encode(Image.new("RGB", (1, 1), (0, 255, 0)))], Q, "1", "ok"),
    ("bomb_100000x100000", [header_only_png(100_000, 100_000)], Q, "3", "image_too_large"),
    ("over_limit_9000x9000", [header_only_png(9000, 9000)], Q, "3", "image_too_large"),
    ("grayscale", [encode(gradient().convert("L"))], Q, "2", "ok"),
    ("cmyk_jpeg", [encode(gradient().convert("CMYK"), "JPEG", quality=95)], Q, "2", "ok"),
    ("rgba", [encode(rgba_half_transparent())], Q, "2", "ok"),
    ("palette", [encode(gradient().convert("P", palette=Image.Palette.ADAPTIVE, colors=16))], Q, "2", "ok"),
    ("palette_transparent", [encode(palette_with_transparency())], Q, "2", "ok"),
    ("sixteen_bit_grey", [encode(sixteen_bit())], Q, "2", "ok"),
    ("missing_answer", [GOOD], Q, None, "missing_answer"),
    ("empty_answer", [GOOD], Q, "   ", "missing_answer"),
    ("wrapped_empty_answer", [GOOD], Q, "<answer> </answer>", "missing_answer"),
    ("empty_problem", [GOOD], "", "3", "empty_problem"),
    ("problem_only_the_tag", [GOOD], "<image>", "3", "empty_problem"),
    ("two_tags_one_image", [GOOD], "<image> and <image>?", "3", "image_count_mismatch"),
    ("prompt_too_long", [GOOD], "count " * 3000 + "<image>", "3", "prompt_too_long"),
    ("problem_not_utf8", [GOOD], b"How many \xff\xfe objects? <image>", "3", "invalid_text"),
    ("answer_not_utf8", [GOOD], Q, b"\xc3\x28", "invalid_text"),
    ("good_last", [GOOD], "Count them. <image>", "4", "ok"),
]


def text_cell(value) -> bytes | None:
    return value.encode("utf-8") if isinstance(value, str) else value


@pytest.fixture(scope="module")
def corpus_parquet(tmp_path_factory):
    """Every corpus row in one parquet. Text columns are binary (as some writers store text), so
    the rows with bytes that are not UTF-8 can live in the same file as the rest."""
    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({
        "images": pa.array([[{"bytes": b, "path": f"{name}.png"} for b in imgs] for name, imgs, *_ in CORPUS],
                           type=image_type),
        "problem": pa.array([text_cell(p) for _, _, p, _, _ in CORPUS], type=pa.binary()),
        "answer": pa.array([text_cell(a) for *_, a, _ in CORPUS], type=pa.binary()),
    })
    path = tmp_path_factory.mktemp("bad") / "corpus.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def processor(tiny_model):
    return load_processor(str(tiny_model))


def dataset(path) -> VLDataset:
    return VLDataset(path, "clevr", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


# --- each row on its own ----------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(CORPUS)), ids=[row[0] for row in CORPUS])
def test_each_row_gets_its_documented_behaviour(corpus_parquet, processor, index):
    name, _, _, answer, expected = CORPUS[index]
    ds = dataset(corpus_parquet)
    try:
        sample = ds.get(index)
        encoded = encode_prompt(processor, sample, "clevr", MAX_PROMPT_TOKENS)
    except BadSample as bad:
        assert bad.reason == expected, (name, bad.reason, bad.detail)
        assert bad.detail, f"{name}: a skip must say why"
        return
    assert expected == "ok", f"{name} was accepted, expected skip reason {expected!r}"
    assert sample.answer == answer
    for img in sample.images:
        assert img.mode == "RGB"
        assert img.width % 28 == 0 and img.height % 28 == 0 and MIN_PIXELS <= img.width * img.height <= MAX_PIXELS
    assert torch.isfinite(encoded.pixel_values).all() and encoded.input_ids.numel() <= MAX_PROMPT_TOKENS


def test_transparent_pixels_become_white_not_black(corpus_parquet):
    names = [row[0] for row in CORPUS]
    img = np.asarray(dataset(corpus_parquet).get(names.index("rgba")).images[0])
    left, right = img[:, : img.shape[1] // 2 - 3], img[:, img.shape[1] // 2 + 3 :]
    assert left.min() >= 250, "transparent half should be composited on white"
    assert right[..., 0].mean() > 180 and right[..., 2].mean() < 40  # opaque red stays red


def test_bomb_is_rejected_from_the_header_without_decoding(corpus_parquet):
    ds = dataset(corpus_parquet)
    start = time.monotonic()
    with pytest.raises(BadSample, match="100000x100000|decompression bomb|exceeds limit"):
        ds.get([row[0] for row in CORPUS].index("bomb_100000x100000"))
    assert time.monotonic() - start < 2.0


# --- the whole corpus through the feeder -------------------------------------------------------
def test_feeder_over_the_whole_corpus_finishes_with_counted_skips(corpus_parquet, processor):
    ds = dataset(corpus_parquet)
    feeder = PromptFeeder(ds, processor, "clevr", seed=0, shuffle=False, max_prompt_tokens=MAX_PROMPT_TOKENS,
                          rank=0, world=1)
    good = [i for i, row in enumerate(CORPUS) if row[4] == "ok"]
    prompts = []
    while len(prompts) < len(good):
        prompts += feeder.next(min(3, len(good) - len(prompts)))
    assert [p.index for p in prompts] == good
    expected = Counter(row[4] for row in CORPUS if row[4] != "ok")
    assert feeder.stats.as_dict() == dict(sorted(expected.items()))
    assert feeder.state_dict()["skips"] == feeder.stats.as_dict()
    assert all(p.answer == CORPUS[p.index][3] for p in prompts)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for p in prompts:  # placeholders expanded to exactly the image's merged patch count
        assert int((p.input_ids == image_pad).sum()) == int(p.image_grid_thw.prod(dim=1).sum()) // 4


# --- text that is not UTF-8 in a JSONL file -----------------------------------------------------
def test_jsonl_lines_that_are_not_utf8_are_skipped_and_counted(tmp_path):
    img = tmp_path / "a.png"
    img.write_bytes(GOOD)
    good = json.dumps({"images": ["a.png"], "problem": Q, "answer": "3"}).encode()
    lines = [good, b'{"images": ["a.png"], "problem": "caf\xe9 <image>", "answer": "3"}',
             b'{"images": ["a.png"], "problem": "lone \\ud800 surrogate <image>", "answer": "3"}', good]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    ds = dataset(path)
    stats = SkipStats()
    loaded = [s.index for s in ds.iter_samples(range(len(ds)), stats)]
    assert loaded == [0, 3] and stats.as_dict() == {"invalid_text": 2}
    with pytest.raises(BadSample, match=r"data\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        ds.get(1)
    with pytest.raises(BadSample, match=r"data\.jsonl:3: .*surrogate"):
        ds.get(2)


# --- rewards on answers that break parsers -----------------------------------------------------
NASTY = [
    "\\frac{1}{0}", "\\frac{", "\\frac{1}{", "}{", "\\sqrt{-4}", "\\sqrt[0]{2}", "0/0", "0^0", "\\infty-\\infty",
    "10^{10^{10^{10}}}", "2^{99999999}", "1e999999", "9" * 5000, "{" * 3000, "(" * 2000 + ")" * 2000,
    "\\frac{" * 300 + "1" + "}{2}" * 300, "\\sqrt{" * 500 + "2" + "}" * 500, "1/" * 2000 + "1",
    "\\pi^{\\pi^{\\pi^{\\pi^{\\pi}}}}", "\\left( \\right.", "\\begin{matrix} 1 & 2 \\\\ 3 & 4 \\end{matrix}",
    "\\\\\\\\", "$$$$", "\\text{\\boxed{", "\\boxed{\\boxed{\\boxed{}}}", "3.5.5", "--1", "nan", "inf", "-0",
    "x = y = z =", "\\displaystyle\\lim_{x\\to 0}\\frac{\\sin x}{x}", "\u202e\u0000\ufffd", "\\operatorname{",
    "1,000,000,000,000,000,000,000", "\\mathrm{}^{}_{}", "^^^^", "\\frac{}{}", "()", "[", "\\" * 999,
]


def _check(result, what: str) -> None:
    assert math.isfinite(result.score) and 0.0 <= result.score <= 1.0, what
    assert result.accuracy in (0.0, 1.0) and 0.0 <= result.format <= 1.0, what
    if result.accuracy < 1.0:
        assert result.reason, f"{what}: a zero accuracy must carry a reason"


@pytest.mark.parametrize("task", ["geo3k", "generic", "clevr"])
def test_rewards_never_raise_on_parser_breaking_latex(task):
    for nasty in NASTY:
        cases = [
            (f"<think>hmm</think>\\boxed{{{nasty}}}", "3.5"),
            (f"<think>x</think><answer>{nasty}</answer>", "3"),
            (nasty, "3.5"),
            ("<think>ok</think>\\boxed{3.5}", nasty),  # a broken gold answer
        ]
        for response, gold in cases:
            start = time.monotonic()
            result = score(task, response, gold, timeout_s=0.5)
            assert time.monotonic() - start < 1.5, f"{task}: {response[:60]!r} took too long"
            _check(result, f"{task}: {response[:60]!r} vs {gold[:60]!r}")


# --- a response holding the image token --------------------------------------------------------
def test_image_token_in_a_response_is_plain_text_to_the_reward():
    pad = "<|image_pad|>"
    r = score("clevr", f"{pad}{pad}<answer>3</answer>", "3")
    assert r.accuracy == 1.0 and r.format == 1.0
    r = score("geo3k", f"<think>{pad}</think>\\boxed{{7}}", "7")
    assert r.accuracy == 1.0 and r.format == 1.0
    r = score("clevr", f"<answer>{pad}</answer>", "3")
    assert r.accuracy == 0.0 and r.reason


def test_engine_never_samples_the_image_token(tiny_model):
    from models.family import build_adapter
    from models.policy import load_model_config
    from rollout.base import SamplingParams
    from rollout.torch_engine import sample_tokens

    adapter = build_adapter(load_model_config(str(tiny_model)))
    banned = adapter.banned_token_ids
    assert adapter.image_token_id in banned
    vocab = int(load_model_config(str(tiny_model)).get_text_config().vocab_size)
    logits = torch.zeros(64, vocab)
    logits[:, adapter.image_token_id] = 50.0  # the model all but insists on the image token
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)):
        tokens, logprobs = sample_tokens(logits, params, banned, gen)
        assert not set(tokens.tolist()) & set(banned), params
        assert torch.isfinite(logprobs).all()


# --- sizes checked before any expensive work -----------------------------------------------------
IMAGE_STRUCTS = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def test_row_sizes_are_checked_before_any_tokenizing_or_decoding(tmp_path, processor, monkeypatch):
    """A 12 MB problem, a 12 MB answer and 600 images are skipped from their sizes alone."""
    huge = "count " * 2_000_000
    rows = [  # (images, problem, answer)
        ([{"bytes": GOOD, "path": None}], Q, "3"),
        ([{"bytes": GOOD[:60], "path": None}], "How many? <image> " + huge, "3"),  # the image is corrupt too
        ([{"bytes": GOOD, "path": None}], Q, huge),
        ([{"bytes": None, "path": "gone.png"}] * 600, "<image>" * 600 + " how many?", "3"),  # files do not exist
        ([{"bytes": GOOD, "path": None}], "Count them. <image>", "4"),
    ]
    path = tmp_path / "sizes.parquet"
    pq.write_table(pa.table({"images": pa.array([r[0] for r in rows], type=IMAGE_STRUCTS),
                             "problem": [r[1] for r in rows], "answer": [r[2] for r in rows]}), path)
    import data.datasets

    decoded = []
    real_decode = data.datasets.decode_image
    monkeypatch.setattr(data.datasets, "decode_image", lambda *a, **kw: decoded.append(1) or real_decode(*a, **kw))
    real_template = processor.apply_chat_template

    def template(messages, **kw):
        assert len(str(messages)) < 100_000, "an over-long text reached the chat template"
        return real_template(messages, **kw)

    monkeypatch.setattr(processor, "apply_chat_template", template)
    feeder = PromptFeeder(dataset(path), processor, "clevr", seed=0, shuffle=False,
                          max_prompt_tokens=MAX_PROMPT_TOKENS)
    start = time.monotonic()
    prompts = feeder.next(2)
    assert time.monotonic() - start < 5.0
    assert [p.index for p in prompts] == [0, 4]
    assert feeder.stats.as_dict() == {"answer_too_long": 1, "prompt_too_long": 1, "too_many_images": 1}
    assert len(decoded) == 2  # only the good rows' images


def test_encode_prompt_refuses_an_over_long_problem_before_the_chat_template(processor, monkeypatch):
    from data.datasets import Sample

    monkeypatch.setattr(processor, "apply_chat_template", lambda *a, **kw: pytest.fail("chat template reached"))
    limit = MAX_PROMPT_TOKENS * processor.max_token_chars
    with pytest.raises(BadSample, match=rf"prompt_too_long: problem has {limit + 1} characters > {limit}"):
        encode_prompt(processor, Sample(0, [], "x" * (limit + 1), "3"), "clevr", MAX_PROMPT_TOKENS)


def test_a_longer_text_than_the_bound_cannot_fit(processor):
    """The bound never refuses a prompt that fits: at max_token_chars characters per token at most."""
    vocab = processor.tokenizer.get_vocab()
    longest = max(vocab, key=len)
    assert processor.max_token_chars == len(longest)
    text = "".join(sorted(vocab, key=len)[-40:])
    assert len(processor.tokenizer.encode(text, add_special_tokens=False)) * processor.max_token_chars >= len(text)


def test_an_images_cell_listing_too_many_is_refused_without_reading_it(tmp_path, monkeypatch):
    path = tmp_path / "many.parquet"
    pq.write_table(pa.table({"images": [["x.png"] * 200_000, ["x.png"]], "problem": [Q, Q], "answer": ["3", "3"]}),
                   path)
    ds = dataset(path)
    ds.bound_rows(max_images=MAX_PROMPT_TOKENS)
    real_cell = VLDataset._cell
    monkeypatch.setattr(VLDataset, "_cell", lambda self, name, i: pytest.fail("converted") if name == "images"
                        and i == 0 else real_cell(self, name, i))
    with pytest.raises(BadSample, match=f"too_many_images: 200000 images > {MAX_PROMPT_TOKENS}"):
        ds.get(0)
    with pytest.raises(BadSample, match="missing_image"):
        ds.get(1)


def test_wrong_cell_types_are_skipped_and_counted_at_run_time(tmp_path, processor):
    (tmp_path / "a.png").write_bytes(GOOD)
    image = pa.list_(pa.struct([("bytes", pa.int64()), ("path", pa.string())]))  # a writer that got `bytes` wrong
    images = [[{"bytes": None, "path": "a.png"}], [{"bytes": 7, "path": None}], [{"bytes": None, "path": "a.png"}]]
    path = tmp_path / "types.parquet"
    pq.write_table(pa.table({"images": pa.array(images, type=image), "problem": [Q] * 3, "answer": ["1", "2", "3"]}),
                   path)
    feeder = PromptFeeder(dataset(path), processor, "clevr", seed=0, shuffle=False,
                          max_prompt_tokens=MAX_PROMPT_TOKENS)
    assert [p.index for p in feeder.next(2)] == [0, 2]
    assert feeder.stats.as_dict() == {"wrong_type": 1}
    with pytest.raises(BadSample, match=r"wrong_type: images\[0\]\.bytes is int; expected binary"):
        dataset(path).get(1)


def test_an_image_over_max_image_bytes_is_refused_before_the_cell_is_converted(tmp_path, monkeypatch):
    path = tmp_path / "big.parquet"
    good, padded = {"bytes": GOOD, "path": None}, {"bytes": GOOD + b"\0" * 5000, "path": None}
    images = pa.array([[good, padded], [good]], type=IMAGE_STRUCTS)
    pq.write_table(pa.table({"images": images, "problem": [Q + Q, Q], "answer": ["3", "3"]}), path)
    ds = VLDataset(path, "clevr", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_image_bytes=len(GOOD) + 100)
    real_cell = VLDataset._cell
    monkeypatch.setattr(VLDataset, "_cell", lambda self, name, i: pytest.fail("converted") if name == "images"
                        and i == 0 else real_cell(self, name, i))
    with pytest.raises(BadSample, match=rf"image_too_large: an image of {len(GOOD) + 5000} bytes > max_image_bytes"):
        ds.get(0)
    assert len(ds.get(1).images) == 1
