"""Image decoding guards, canonical sizes, prompts and the dataset loaders."""

import io
import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data.datasets import SkipStats, VLDataset, inspect_file
from data.images import BadSample, canonicalize_image, decode_image, smart_resize_dims, to_rgb
from data.prompts import TASK_INSTRUCTIONS, build_messages, build_prompt_text

REPO = Path(__file__).resolve().parent.parent
IMAGE_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def png_bytes(size=(40, 30), color=(10, 200, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def huge_header_png(width=100_000, height=100_000) -> bytes:
    """A tiny PNG whose IHDR claims an enormous size (with a valid CRC)."""
    data = bytearray(png_bytes((4, 4)))
    # Signature (8) + chunk length (4) + b"IHDR" (4), then width and height.
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def write_parquet(path, rows, images_type=IMAGE_TYPE):
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    fields = [(k, images_type if k == "images" else pa.string()) for k in columns]
    pq.write_table(pa.Table.from_pydict(columns, schema=pa.schema(fields)), path)
    return path


def img(data, name="x.png"):
    return [{"bytes": data, "path": name}]


# ----------------------------------------------------------------------- decode_image

def test_truncated_png_is_corrupt():
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    with pytest.raises(BadSample) as err:
        decode_image(buf.getvalue()[: len(buf.getvalue()) // 2])
    assert err.value.reason == "corrupt_image"


@pytest.mark.parametrize("data", [b"", b"definitely not an image", np.random.default_rng(1).bytes(500)])
def test_non_image_bytes(data):
    with pytest.raises(BadSample) as err:
        decode_image(data)
    assert err.value.reason == "not_an_image"


def test_huge_header_rejected_before_decoding():
    start = time.perf_counter()
    with pytest.raises(BadSample) as err:
        decode_image(huge_header_png())
    assert err.value.reason == "image_too_large"
    assert time.perf_counter() - start < 1.0
    # Below PIL's own limits our threshold still applies, from the header alone.
    with pytest.raises(BadSample) as err:
        decode_image(huge_header_png(5000, 5000), max_image_pixels=1_000_000)
    assert err.value.reason == "image_too_large" and "5000x5000" in str(err.value)


def test_missing_path(tmp_path):
    with pytest.raises(BadSample) as err:
        decode_image(tmp_path / "nope.png")
    assert err.value.reason == "missing_image"


def _encode(image, fmt="PNG"):
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_modes_become_rgb():
    cases = {
        "L": (Image.new("L", (4, 4), 100), (100, 100, 100)),
        "LA transparent": (Image.new("LA", (4, 4), (0, 0)), (255, 255, 255)),
        "RGBA transparent": (Image.new("RGBA", (4, 4), (255, 0, 0, 0)), (255, 255, 255)),
        "RGBA opaque": (Image.new("RGBA", (4, 4), (255, 0, 0, 255)), (255, 0, 0)),
        "1": (Image.new("1", (4, 4), 1), (255, 255, 255)),
        "I;16": (Image.new("I;16", (4, 4), 65535), (255, 255, 255)),
        "I;16 mid": (Image.new("I;16", (4, 4), 32896), (128, 128, 128)),
    }
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 255] + [0] * 765)
    cases["P"] = (palette, (0, 0, 255))
    see_through = palette.copy()
    see_through.info["transparency"] = 0
    cases["P transparent"] = (see_through, (255, 255, 255))
    for name, (image, expected) in cases.items():
        out = decode_image(_encode(image))
        assert out.mode == "RGB" and out.getpixel((1, 1)) == expected, name
    cmyk = decode_image(_encode(Image.new("CMYK", (4, 4), (0, 0, 0, 0)), fmt="JPEG"))
    assert cmyk.mode == "RGB" and min(cmyk.getpixel((1, 1))) > 245


def test_pa_mode_composited_on_white():
    pa_image = Image.new("PA", (4, 4), (0, 0))
    pa_image.putpalette([255, 0, 0] + [0] * 765)
    assert to_rgb(pa_image).getpixel((0, 0)) == (255, 255, 255)


def test_one_pixel_image_is_upscaled_to_the_minimum_grid():
    out = canonicalize_image(decode_image(png_bytes((1, 1))), min_pixels=28 * 28, max_pixels=512 * 28 * 28)
    assert out.size == (28, 28) and out.getpixel((5, 5)) == (10, 200, 30)


# ---------------------------------------------------------------- canonical sizes

@pytest.mark.parametrize("min_pixels,max_pixels", [(28 * 28, 512 * 28 * 28), (56 * 56, 28 * 28 * 64),
                                                   (4 * 28 * 28, 16 * 28 * 28)])
def test_canonical_sizes_on_grid_and_within_bounds(min_pixels, max_pixels):
    for height, width in [(1, 1), (13, 500), (224, 224), (300, 701), (1080, 1920), (4000, 3000), (29, 29)]:
        h, w = smart_resize_dims(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
        assert min_pixels <= h * w <= max_pixels, (height, width, h, w)
        # A canonical size is a fixed point: a processor applying the rule again keeps it.
        assert smart_resize_dims(h, w, min_pixels=min_pixels, max_pixels=max_pixels) == (h, w)
        if min(height, width) >= 56:
            assert abs(h / w - height / width) / (height / width) < 0.25


def test_canonicalize_image_resizes_rgb():
    image = Image.new("L", (500, 300), 7)
    out = canonicalize_image(image, min_pixels=28 * 28, max_pixels=64 * 28 * 28)
    assert out.mode == "RGB" and out.size[0] % 28 == 0 and out.size[1] % 28 == 0
    assert out.size[0] * out.size[1] <= 64 * 28 * 28 and out.size[0] > out.size[1]


@pytest.mark.slow  # importing transformers takes seconds
def test_matches_transformers_smart_resize():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        try:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        except ImportError:
            pytest.skip("no importable Qwen2-VL smart_resize in this transformers")
    rng = np.random.default_rng(0)
    for height, width in rng.integers(20, 3000, size=(300, 2)):
        h, w = int(height), int(width)
        if max(h, w) / min(h, w) > 200:
            continue
        kw = dict(factor=28, min_pixels=56 * 56, max_pixels=256 * 28 * 28)
        assert smart_resize_dims(h, w, **kw) == tuple(smart_resize(h, w, **kw)), (h, w)


def test_extreme_aspect_ratio():
    with pytest.raises(BadSample) as err:
        smart_resize_dims(10, 2100, min_pixels=784, max_pixels=10**6)
    assert err.value.reason == "bad_aspect_ratio"


# --------------------------------------------------------------------------- prompts

def test_build_messages_places_images_at_tags():
    (message,) = build_messages(("<image>Left.<image>Right \\frac{1}{2}", [None, None]), "generic")
    assert message["role"] == "user"
    assert [p["type"] for p in message["content"]] == ["image", "text", "image", "text"]
    assert message["content"][1]["text"] == "Left."
    assert message["content"][3]["text"] == "Right \\frac{1}{2} Give the final answer in <answer> </answer>."


def test_build_messages_images_first_without_tags():
    (message,) = build_messages(("How many?", [None]), "clevr")
    assert message["content"][0] == {"type": "image"}
    assert message["content"][1]["text"] == build_prompt_text("How many?", "clevr")
    with pytest.raises(ValueError, match="2 <image> tags but 1 images"):
        build_messages(("<image><image>x", [None]), "clevr")


def test_unknown_task_lists_known_tasks():
    with pytest.raises(ValueError) as err:
        build_prompt_text("x", "vqa")
    for task in TASK_INSTRUCTIONS:
        assert task in str(err.value)


def test_geo3k_instruction_keeps_braces():
    text = build_prompt_text("<image>Find x.", "geo3k")
    assert text.startswith("<image>Find x.") and "<think>" in text and "\\boxed{}" in text


# --------------------------------------------------------------------------- datasets

def _good_rows(n):
    return [{"images": img(png_bytes((60 + i, 50))), "problem": f"<image>How many {i}?", "answer": str(i)}
            for i in range(n)]


def test_parquet_with_two_corrupt_rows(tmp_path, caplog):
    rows = _good_rows(5)
    rows[1]["images"] = img(png_bytes()[:40])
    rows[3]["images"] = img(b"\x00garbage\xff" * 10)
    path = write_parquet(tmp_path / "mixed.parquet", rows)
    dataset = VLDataset(path, "clevr", max_pixels=28 * 28 * 4)  # construction decodes nothing
    assert len(dataset) == 5
    stats = SkipStats()
    with caplog.at_level(logging.WARNING):
        samples = list(dataset.iter_samples(range(len(dataset)), stats))
    assert [s.index for s in samples] == [0, 2, 4]
    assert [s.answer for s in samples] == ["0", "2", "4"]
    assert stats.total == 2 and sum(stats.as_dict().values()) == 2
    # A cut-off PNG is damaged; bytes with no image signature are not an image at all.
    assert stats.as_dict() == {"corrupt_image": 1, "not_an_image": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "row 1 of" in warnings[0] and "mixed.parquet" in warnings[0]
    for sample in samples:
        (image,) = sample.images
        assert image.mode == "RGB" and image.size[0] % 28 == 0 and image.size[1] % 28 == 0
        assert image.size[0] * image.size[1] <= 28 * 28 * 4


def test_bad_text_fields(tmp_path):
    rows = _good_rows(6)
    rows[0]["problem"] = "   "
    rows[1]["problem"] = "<image>"
    rows[2]["answer"] = None
    rows[3]["answer"] = "  "
    rows[4]["problem"] = "<image><image>Compare."
    path = write_parquet(tmp_path / "text.parquet", rows)
    dataset = VLDataset(path, "generic")
    reasons = []
    for i in range(5):
        with pytest.raises(BadSample) as err:
            dataset.get(i)
        reasons.append(err.value.reason)
    assert reasons == ["empty_problem", "empty_problem", "missing_answer", "missing_answer",
                       "image_count_mismatch"]
    assert dataset.get(5).answer == "5"
    with pytest.raises(IndexError):
        dataset.get(6)


def test_missing_column_names_it(tmp_path):
    path = tmp_path / "noanswer.parquet"
    pq.write_table(pa.table({"images": pa.array([img(png_bytes())], IMAGE_TYPE), "problem": ["<image>q"]}), path)
    with pytest.raises(ValueError) as err:
        VLDataset(path, "clevr")
    message = str(err.value)
    assert "'answer'" in message and "noanswer.parquet" in message and "'problem'" in message


def test_aliases_single_struct_and_untagged_problem(tmp_path):
    path = tmp_path / "alias.parquet"
    struct_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "image": pa.array([{"bytes": png_bytes(), "path": None}], struct_type),
        "question": ["How many cubes?"],
        "solution": ["<answer> 3 </answer>"],
    })
    pq.write_table(table, path)
    sample = VLDataset(path, "clevr").get(0)
    assert sample.problem == "<image>How many cubes?" and sample.answer == "3"
    assert len(sample.images) == 1


def test_path_strings_relative_to_the_file(tmp_path, monkeypatch):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes((90, 90)))
    path = tmp_path / "paths.parquet"
    pq.write_table(pa.table({"images": [["pics/a.png"], ["pics/missing.png"]], "problem": ["<image>q", "<image>q"],
                             "answer": ["1", "2"]}), path)
    monkeypatch.chdir(REPO)
    dataset = VLDataset(path, "generic")
    assert dataset.get(0).images[0].size == (84, 84)
    with pytest.raises(BadSample) as err:
        dataset.get(1)
    assert err.value.reason == "missing_image"


def test_jsonl_generic_loader(tmp_path, monkeypatch):
    folder = tmp_path / "set"
    (folder / "imgs").mkdir(parents=True)
    (folder / "imgs" / "0.png").write_bytes(png_bytes((100, 60), mode="L", color=50))
    absolute = tmp_path / "abs.png"
    absolute.write_bytes(png_bytes((30, 30)))
    lines = [
        {"images": ["imgs/0.png"], "problem": "<image>Describe.", "answer": 7},
        {"images": [str(absolute), "imgs/0.png"], "problem": "<image>A <image>B", "answer": "x"},
        {"images": [], "problem": "Text only.", "answer": "y"},
        {"images": ["imgs/0.png"], "problem": "<image>Q", "answer": ""},
    ]
    path = folder / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    monkeypatch.chdir(tmp_path)  # paths must resolve against the JSONL's folder, not the cwd
    dataset = VLDataset(path, "generic")
    first, second, third = dataset.get(0), dataset.get(1), dataset.get(2)
    assert first.answer == "7" and first.images[0].mode == "RGB"
    assert first.images[0].getpixel((0, 0)) == (50, 50, 50)
    assert [im.size for im in second.images] == [(28, 28), (112, 56)]
    assert third.images == [] and third.problem == "Text only."
    stats = SkipStats()
    assert len(list(dataset.iter_samples(range(4), stats))) == 3
    assert stats.as_dict() == {"missing_answer": 1}


def test_jsonl_bad_line_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"images": [], "problem": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        VLDataset(path, "generic")


def test_inspect_cli_json(tmp_path):
    rows = _good_rows(4)
    rows[2]["images"] = img(huge_header_png())
    rows[3]["answer"] = None
    path = write_parquet(tmp_path / "inspect.parquet", rows)
    result = subprocess.run([sys.executable, "-m", "data.datasets", "inspect", str(path), "--task", "clevr"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {"rows", "loaded", "skipped", "skip_reasons", "first_prompt"} <= set(summary)
    assert (summary["rows"], summary["loaded"], summary["skipped"]) == (4, 2, 2)
    assert summary["skip_reasons"] == {"image_too_large": 1, "missing_answer": 1}
    assert summary["first_prompt"] == "user: " + build_prompt_text("<image>How many 0?", "clevr")
    assert "row 2 of" in result.stderr
    assert inspect_file(str(path), "clevr", max_rows=1)["loaded"] == 1


def test_inspect_cli_missing_column_exits_with_message(tmp_path):
    path = tmp_path / "noproblem.parquet"
    pq.write_table(pa.table({"images": pa.array([img(png_bytes())], IMAGE_TYPE), "answer": ["1"]}), path)
    result = subprocess.run([sys.executable, "-m", "data.datasets", "inspect", str(path), "--task", "clevr"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "missing required column 'problem'" in result.stderr and "noproblem.parquet" in result.stderr


@pytest.mark.slow  # the subprocess imports transformers
def test_inspect_cli_with_local_chat_template(tmp_path):
    """--model applies the folder's chat template (a tokenizer-only folder is enough)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}"
        "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    model_dir = tmp_path / "tok"
    tokenizer.save_pretrained(model_dir)
    path = write_parquet(tmp_path / "one.parquet", _good_rows(1))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "data.datasets", "inspect", str(path), "--task", "geo3k",
                             "--model", str(model_dir)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    prompt = json.loads(result.stdout)["first_prompt"]
    expected_text = build_prompt_text("How many 0?", "geo3k")
    assert prompt == (f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{expected_text}"
                      "<|im_end|>\n<|im_start|>assistant\n")


# Cells whose arrow type is not what the schema expects: (column, arrow type, value, detail).
STRUCT_INT_BYTES = pa.struct([("bytes", pa.int64()), ("path", pa.string())])
STRUCT_INT_PATH = pa.struct([("bytes", pa.binary()), ("path", pa.int64())])
WRONG_TYPES = [
    ("images", pa.int64(), 5, "images is int"),
    ("images", pa.float64(), 1.5, "images is float"),
    ("images", pa.bool_(), True, "images is bool"),
    ("images", pa.timestamp("s"), 0, "images is datetime"),
    ("images", pa.list_(pa.int64()), [1, 2], r"images\[0\] is int"),
    ("images", pa.list_(pa.list_(pa.string())), [["a.png"]], r"images\[0\] is list"),
    ("images", pa.map_(pa.string(), pa.string()), [("bytes", "x")], r"images\[0\] is tuple"),
    ("images", STRUCT_INT_BYTES, {"bytes": 5, "path": None}, r"images\[0\]\.bytes is int"),
    ("images", pa.list_(STRUCT_INT_BYTES), [{"bytes": 5, "path": "a.png"}], r"images\[0\]\.bytes is int"),
    ("images", pa.list_(STRUCT_INT_PATH), [{"bytes": None, "path": 3}], r"images\[0\]\.path is int"),
    ("images", pa.struct([("bytes", pa.string())]), {"bytes": "aGk="}, r"images\[0\]\.bytes is str"),
    ("problem", pa.int64(), 7, "problem is int"),
    ("problem", pa.list_(pa.string()), ["<image>", "how many?"], "problem is list"),
    ("problem", pa.struct([("text", pa.string())]), {"text": "<image> q"}, "problem is dict"),
    ("answer", pa.list_(pa.int64()), [3], "answer is list"),
    ("answer", pa.struct([("value", pa.int64())]), {"value": 3}, "answer is dict"),
    ("answer", pa.bool_(), True, "answer is True"),
]


@pytest.mark.parametrize("column,arrow_type,value,detail", WRONG_TYPES,
                         ids=[f"{c}-{t}" for c, t, *_ in WRONG_TYPES])
def test_a_cell_of_the_wrong_type_is_a_bad_sample(tmp_path, column, arrow_type, value, detail):
    columns = {"images": pa.array([[{"bytes": png_bytes(), "path": None}]], type=IMAGE_TYPE),
               "problem": pa.array(["<image> How many?"]), "answer": pa.array(["3"])}
    columns[column] = pa.array([value], type=arrow_type)
    path = tmp_path / "types.parquet"
    pq.write_table(pa.table(columns), path)
    dataset = VLDataset(path, "generic")
    with pytest.raises(BadSample) as err:
        dataset.get(0)
    assert err.value.reason == "wrong_type" and "\n" not in str(err.value)
    assert re.search(detail, err.value.detail), err.value.detail
    stats = SkipStats()
    assert list(dataset.iter_samples([0], stats)) == [] and stats.as_dict() == {"wrong_type": 1}


def test_row_bounds_tighten_and_are_checked(tmp_path):
    path = write_parquet(tmp_path / "b.parquet", _good_rows(2))
    dataset = VLDataset(path, "generic", max_images=4, max_text_chars=100)
    dataset.bound_rows(max_images=8, max_text_chars=5)
    assert (dataset.max_images, dataset.max_text_chars) == (4, 5)
    with pytest.raises(BadSample, match="prompt_too_long: problem has"):
        dataset.get(0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_images must be a positive integer"):
            dataset.bound_rows(max_images=bad)


def test_trajectory_rows_get_the_same_size_and_type_checks(tmp_path):
    """A `messages` file (read by data/trajectories.py): image count, image field types and the
    conversation's size are checked from arrow before the row is converted."""
    turn = pa.struct([("role", pa.string()), ("content", pa.string())])

    def write(name, images, image_type=IMAGE_TYPE, text="<image> How many?"):
        messages = [[{"role": "user", "content": text}, {"role": "assistant", "content": "<answer>3</answer>"}]]
        table = pa.table({"messages": pa.array(messages, type=pa.list_(turn)),
                          "images": pa.array([images], type=image_type), "answer": ["3"]})
        pq.write_table(table, tmp_path / name)
        return VLDataset(tmp_path / name, "generic")

    good = {"bytes": png_bytes(), "path": None}
    assert len(write("good.parquet", [good]).get(0).images) == 1
    int_bytes = pa.list_(pa.struct([("bytes", pa.int64()), ("path", pa.string())]))
    with pytest.raises(BadSample, match="wrong_type: images' bytes field has arrow type int64; expected binary"):
        write("types.parquet", [{"bytes": 5, "path": None}], int_bytes).get(0)
    many = write("many.parquet", [good] * 3, text="<image>" * 3 + " How many?")
    many.bound_rows(max_images=2)
    with pytest.raises(BadSample, match="too_many_images: 3 images > 2"):
        many.get(0)
    long = write("long.parquet", [good], text="<image> " + "count " * 2000)
    long.bound_rows(max_text_chars=100)
    with pytest.raises(BadSample, match=r"prompt_too_long: messages holds \d+ bytes, more than 100 characters"):
        long.get(0)


def test_size_checks_count_only_the_row(tmp_path):
    """40 problems of 2 kB: the column holds 80 kB, each row is within a 5,000-character bound
    (also dictionary-encoded, as pandas categoricals are stored, where every row shares the values)."""
    problems = [f"<image> how many {i}? " + "x" * 2000 for i in range(40)]
    images = pa.array([img(png_bytes())] * 40, type=IMAGE_TYPE)
    for name, column in (("plain", pa.array(problems)), ("dictionary", pa.array(problems).dictionary_encode())):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"images": images, "problem": column, "answer": ["3"] * 40}), path)
        dataset = VLDataset(path, "generic", max_text_chars=5000)
        assert dataset.get(17).problem == problems[17]
        dataset.bound_rows(max_text_chars=1000)
        with pytest.raises(BadSample, match="prompt_too_long"):
            dataset.get(17)
