"""The zoom task's data: DeepEyes-47k-schema rows, SFT trajectories, the reader and the reward."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data.datasets import SkipStats, VLDataset
from data.generators.zoom import CHECKS, QUESTION, SCHEMA, SYSTEM, cells, generate
from data.images import BadSample
from data.rewards import score
from rollout.tools import ImageZoomInTool, ToolContext
from tools.make_dataset import main as make_dataset_main
from tools.make_dataset import make_dataset

PIXELS = dict(min_pixels=3136, max_pixels=12544)


@pytest.fixture(scope="module")
def zoom_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoom")
    rl = make_dataset("zoom", 16, 0, folder / "zoom.parquet", **PIXELS)
    sft = make_dataset("zoom_sft", 8, 1, folder / "zoom_sft.parquet", **PIXELS)
    return rl, sft


def nearest_class(image: Image.Image) -> str:
    """Which colour pair a zoomed checkerboard shows: the pair whose colours are nearest its pixels."""
    pixels = np.asarray(image).reshape(-1, 3).astype(float)
    cost = {name: np.minimum(np.abs(pixels - np.array(a)).sum(1), np.abs(pixels - np.array(b)).sum(1)).mean()
            for name, (a, b) in CHECKS.items()}
    return min(cost, key=cost.get)


def test_rows_have_deepeyes_schema_and_load(zoom_files):
    rl, _ = zoom_files
    table = pq.read_table(rl)
    assert table.schema.equals(SCHEMA)
    assert table.column_names == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    row = table.slice(0, 1).to_pylist()[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"].count("<image>") == 1
    assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"] in CHECKS
    assert row["extra_info"]["answer"] == row["reward_model"]["ground_truth"]
    assert generate(3, 0, **PIXELS)[2] == generate(5, 0, **PIXELS)[2]  # row i depends on (seed, i) only

    ds = VLDataset(rl, "zoom", **PIXELS)
    samples = list(ds.iter_samples(range(len(ds)), SkipStats()))
    assert len(samples) == 16
    sample = samples[0]
    assert sample.problem == "<image>" + QUESTION and sample.answer == row["reward_model"]["ground_truth"]
    assert sample.images[0].size == (112, 112) and sample.originals[0].size == (448, 448)
    assert {s.answer for s in samples} == set(CHECKS)


def test_colour_is_unreadable_in_the_seen_image_and_readable_after_zooming(zoom_files):
    rl, _ = zoom_files
    ds, table = VLDataset(rl, "zoom", **PIXELS), pq.read_table(rl)
    views = {}
    for i in range(len(ds)):
        sample = ds.get(i)
        box = json.loads(table.column("extra_info")[i].as_py()["bbox_2d"])
        seen = np.asarray(sample.images[0]).astype(int)
        cell = seen[box[1]:box[3], box[0]:box[2]]
        views.setdefault(sample.answer, cell)
        ctx = ToolContext(images=sample.images, originals=sample.originals, **PIXELS)
        zoomed = ImageZoomInTool()({"bbox_2d": box}, ctx).images[0]
        assert zoomed.size == (112, 112) and nearest_class(zoomed) == sample.answer
        # without the original, the crop comes from the seen image and the colour is gone
        blurred = ImageZoomInTool()({"bbox_2d": box}, ToolContext(images=sample.images, **PIXELS)).images[0]
        assert np.asarray(blurred)[12:-12, 12:-12].astype(int).std() < 3
    assert len(views) == 4
    first = next(iter(views.values()))  # every colour pair is the same grey at the model's view
    assert all(np.abs(v - first).max() <= 5 for v in views.values())
    assert np.abs(first[2:-2, 2:-2] - first[14, 14]).max() <= 2  # a flat grey inside


def test_framed_square_is_visible_in_the_seen_image(zoom_files):
    rl, _ = zoom_files
    ds, table = VLDataset(rl, "zoom", **PIXELS), pq.read_table(rl)
    for i in range(6):
        seen = np.asarray(ds.get(i).images[0]).astype(int).sum(-1)
        box = json.loads(table.column("extra_info")[i].as_py()["bbox_2d"])
        darkest = min(range(4), key=lambda k: _ring(seen, _seen_cell(k)))
        assert _seen_cell(darkest) == box


def _seen_cell(k: int) -> list[int]:
    return [v // 4 for v in cells(448)[k]]


def _ring(seen: np.ndarray, box: list[int]) -> float:
    x1, y1, x2, y2 = box
    return seen[y1 - 2:y1, x1:x2].mean()  # just above the square: the frame, or background


def test_sft_rows_call_the_tool_as_it_answers_at_run_time(zoom_files):
    _, sft = zoom_files
    row = pq.read_table(sft).slice(0, 1).to_pylist()[0]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]  # the RL rows' system turn too
    assert row["messages"][0]["content"] == SYSTEM
    row["messages"] = row["messages"][1:]
    call = row["messages"][1]["content"]
    assert call.startswith("<tool_call>") and call.endswith("</tool_call>")
    arguments = json.loads(call[len("<tool_call>"):-len("</tool_call>")])
    assert arguments["name"] == "image_zoom_in_tool"
    assert row["messages"][2]["content"] == "<tool_response><image></tool_response>"
    assert row["messages"][3]["content"] == f"<answer>{row['answer']}</answer>"

    ds = VLDataset(sft, "zoom", **PIXELS)
    sample = ds.get(0)
    assert sample.conversation is not None and len(sample.conversation_images) == 2
    assert len(sample.images) == 1 and sample.problem == "<image>" + QUESTION
    ctx = ToolContext(images=sample.images, originals=sample.originals, **PIXELS)
    at_run_time = ImageZoomInTool()(arguments["arguments"], ctx).images[0]
    stored = sample.conversation_images[1]
    assert stored.size == at_run_time.size
    assert np.array_equal(np.asarray(stored), np.asarray(at_run_time))
    assert nearest_class(stored) == row["answer"]


def _image_bytes(colour=(10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (60, 40), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_deepeyes_style_rows_and_bad_rows(tmp_path):
    """Rows as DeepEyes-47k has them (string content with <image>, ground truth in reward_model),
    content given as parts, and bad rows skipped with a counted reason."""
    image = [{"bytes": _image_bytes(), "path": None}]
    prompts = [
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "<image>\nWhat is it?"}],
        [{"role": "user", "content": "Where? <image>"}],
        [{"role": "user", "content": "no image tag"}],  # one image, no tag: mismatch
        [{"role": "critic", "content": "<image>x"}],  # unknown role
        [{"role": "user", "content": "<image>ok"}],  # no ground truth
    ]
    truths = ["a cat", "left", "x", "x", None]
    table = pa.table({
        "data_source": ["d"] * 5,
        "prompt": prompts,
        "images": [image] * 5,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
    })
    path = tmp_path / "deepeyes.parquet"
    pq.write_table(table, path)
    ds = VLDataset(path, "zoom", **PIXELS)
    first = ds.get(0)
    assert first.problem == "<image>\nWhat is it?" and first.answer == "a cat" and first.system == "sys"
    assert first.images[0].size[0] % 28 == 0 and first.originals[0].size == (60, 40)
    assert ds.get(1).problem == "Where? <image>"
    stats = SkipStats()
    assert [s.index for s in ds.iter_samples(range(5), stats)] == [0, 1]
    assert stats.as_dict() == {"bad_message": 1, "image_count_mismatch": 1, "missing_answer": 1}
    with pytest.raises(BadSample, match="role 'critic'"):
        ds.get(3)


def test_zoom_reward():
    assert score("zoom", "<answer>Red</answer>", "red").score == pytest.approx(1.0)
    assert score("zoom", "<answer>blue</answer>", "red").score == pytest.approx(0.2)
    assert score("zoom", '<tool_call>{"name": "x"}</tool_call>', "red").score == 0.0
    assert score("zoom", "<answer>red</answer> and more", "red").score == pytest.approx(0.8)


def test_places_limits_which_square_is_framed():
    boxes = {n: {json.loads(r["extra_info"]["bbox_2d"])[0:2].__repr__() for r in generate(40, 0, places=n, **PIXELS)}
             for n in (1, 2, 4)}
    assert [len(boxes[n]) for n in (1, 2, 4)] == [1, 2, 4]
    with pytest.raises(ValueError, match="places"):
        generate(1, 0, places=3)


def test_make_dataset_cli_for_zoom(tmp_path, capsys):
    out = tmp_path / "z.parquet"
    assert make_dataset_main(["--kind", "zoom_sft", "--n", "2", "--seed", "3", "--out", str(out),
                              "--max-pixels", "12544"]) == 0
    assert pq.read_table(out).column_names == ["messages", "images", "answer", "data_source"]
    with pytest.raises(ValueError, match="parquet only"):
        make_dataset("zoom", 2, 0, tmp_path / "z.jsonl")
    with pytest.raises(ValueError, match="readable without zooming"):
        make_dataset("zoom", 2, 0, tmp_path / "big.parquet", max_pixels=448 * 448)
    with pytest.raises(SystemExit):
        make_dataset_main(["--kind", "clevr", "--n", "2", "--out", str(tmp_path / "c.parquet"), "--max-pixels", "9"])
