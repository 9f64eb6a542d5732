"""Tests of rollout/tools.py: the built-in tools, the registry and the ToolRunner's failure handling."""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from rollout.tools import (ERROR_KINDS, Calculator, ImageZoomInTool, ToolArgumentError, ToolContext, ToolResult,
                           ToolRunner, build_tools, evaluate_arithmetic, register_tool)

USER_TOOLS = '''
import os, time
from PIL import Image
from rollout.tools import Tool, ToolResult, register_tool

class SleepTool(Tool):
    name = "sleepy"
    description = "writes its pid, then sleeps"
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}, "pid_file": {"type": "string"}},
                  "required": ["seconds"]}
    def __call__(self, arguments, ctx):
        if "pid_file" in arguments:
            with open(arguments["pid_file"], "w") as f:
                f.write(str(os.getpid()))
        time.sleep(arguments["seconds"])
        return ToolResult(text="awake")

class BrokenTool(Tool):
    name = "broken"
    description = "raises"
    parameters = {"type": "object", "properties": {}}
    def __call__(self, arguments, ctx):
        print("noise on stdout must not break the pipe")
        raise RuntimeError("boom\\nsecond line")

class HugeImageTool(Tool):
    name = "huge"
    description = "returns an image above the pixel limit"
    parameters = {"type": "object", "properties": {}}
    def __call__(self, arguments, ctx):
        return ToolResult(images=[Image.new("RGB", (ctx.max_pixels, 2))])

class ExitTool(Tool):
    name = "exits"
    description = "kills its own process"
    parameters = {"type": "object", "properties": {}}
    def __call__(self, arguments, ctx):
        os._exit(3)

class InspectTool(Tool):
    name = "inspect"
    description = "reports the red value of each image's first pixel"
    parameters = {"type": "object", "properties": {}}
    def __call__(self, arguments, ctx):
        return ToolResult(text=" ".join(str(im.getpixel((0, 0))[0]) for im in ctx.images))

for cls in (SleepTool, BrokenTool, HugeImageTool, ExitTool, InspectTool):
    register_tool(cls())
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_tools")
    (folder / "vlrl_test_user_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    import sys
    sys.path.insert(0, str(folder))
    yield "vlrl_test_user_tools"
    sys.path.remove(str(folder))


def coordinate_image(size: int = 224) -> Image.Image:
    """R = x, G = y, so each pixel says where it came from."""
    ys, xs = np.mgrid[0:size, 0:size]
    pixels = np.stack([xs, ys, np.full_like(xs, 128)], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def ctx_for(image: Image.Image, max_pixels: int = 128 * 64) -> ToolContext:
    return ToolContext(images=[image, Image.new("RGB", (56, 56), "white")], min_pixels=28 * 28, max_pixels=max_pixels)


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def check_zoom(result: ToolResult, box: tuple[int, int, int, int]) -> None:
    (out,) = result.images
    x1, y1, x2, y2 = box
    assert out.mode == "RGB" and out.size == (2 * (x2 - x1), 2 * (y2 - y1))  # 64x32 box, 8192-pixel limit: 2x
    arr = np.asarray(out).astype(int)
    # away from the border, output pixel (i, j) shows input pixel (x1 + i/2, y1 + j/2)
    for i, j in [(4, 4), (60, 10), (100, 50), (123, 27)]:
        assert abs(arr[j, i, 0] - (x1 + i / 2)) <= 1.5, (i, j, arr[j, i])
        assert abs(arr[j, i, 1] - (y1 + j / 2)) <= 1.5, (i, j, arr[j, i])


def test_zoom_crops_the_box_of_the_first_image():
    box = (40, 60, 104, 92)
    check_zoom(ImageZoomInTool()({"bbox_2d": list(box)}, ctx_for(coordinate_image())), box)


def test_zoom_cuts_from_the_original_in_seen_coordinates(user_module):
    """The box is in the coordinates of the image the model saw (here half size); the crop comes
    from the full-resolution original, so it holds detail the seen image lost."""
    original = coordinate_image()
    seen = original.resize((112, 112), Image.Resampling.BICUBIC)
    ctx = ToolContext(images=[seen], min_pixels=28 * 28, max_pixels=128 * 64, originals=[original])
    check_zoom(ImageZoomInTool()({"bbox_2d": [20, 30, 52, 46]}, ctx), (40, 60, 104, 92))
    with ToolRunner(build_tools(["image_zoom_in_tool", "inspect"], user_module), max_workers=1, timeout_s=30) as runner:
        zoomed, inspected = runner.run([(call("image_zoom_in_tool", bbox_2d=[20, 30, 52, 46]), ctx),
                                        (call("inspect"), ToolContext([seen], 1, 64, originals=[None]))])
    check_zoom(zoomed.result, (40, 60, 104, 92))
    assert inspected.result.text == str(seen.getpixel((0, 0))[0])


def test_zoom_through_the_runner_and_its_schema(user_module):
    tools = build_tools(["image_zoom_in_tool", "calculator"])
    schema = tools["image_zoom_in_tool"].schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "image_zoom_in_tool"
    assert schema["function"]["parameters"]["required"] == ["bbox_2d"]
    box = (100, 20, 164, 52)
    with ToolRunner(tools, max_workers=2, timeout_s=30) as runner:
        outcomes = runner.run([(call("image_zoom_in_tool", bbox_2d=list(box), label="x"), ctx_for(coordinate_image())),
                               (call("calculator", expression="(3 + 4) * 2 ** 3 - 7 // 2"), ctx_for(coordinate_image()))])
    assert [o.error_kind for o in outcomes] == [None, None]
    check_zoom(outcomes[0].result, box)
    assert outcomes[1].result.text == "53" and outcomes[1].result.images == []


def test_zoom_refuses_bad_boxes():
    tool, ctx = ImageZoomInTool(), ctx_for(coordinate_image())
    for box, words in [([-1, 0, 50, 50], "outside"), ([0, 0, 225, 50], "outside"), ([10, 10, 10, 50], "degenerate"),
                       ([10, 10, 12, 50], "degenerate"), ([0, 0, 224, 5], "too thin"), ([1, 2, 3], "list"),
                       ([0, 0, float("nan"), 4], "finite")]:
        with pytest.raises(ToolArgumentError, match=words):
            tool({"bbox_2d": box}, ctx)


def test_each_failure_kind_is_counted_and_never_raises(user_module, tmp_path):
    tools = build_tools(["image_zoom_in_tool", "calculator", "sleepy", "broken", "huge", "exits"], user_module)
    ctx = ctx_for(coordinate_image())
    calls = {
        "malformed_json": ['{"name": "calculator", "arguments": {', "[1, 2]", '{"arguments": {}}'],
        "unknown_tool": [call("rotate", angle=90)],
        "bad_arguments": [call("image_zoom_in_tool", bbox_2d=[0, 0, 500, 500]), call("image_zoom_in_tool"),
                          call("calculator", expression="__import__('os')"), call("calculator", expr="1"),
                          call("image_zoom_in_tool", bbox_2d="0 0 5 5")],
        "tool_exception": [call("broken"), call("huge"), call("exits")],
        "timeout": [call("sleepy", seconds=60)],
        None: [call("sleepy", seconds=0), call("calculator", expression="2 ** 10")],
    }
    flat = [(raw, kind) for kind, raws in calls.items() for raw in raws]
    with ToolRunner(tools, max_workers=3, timeout_s=2.0) as runner:
        outcomes = runner.run([(raw, ctx) for raw, _ in flat])
        again = runner.run([(call("calculator", expression="1 + 1"), ctx)])  # still serves after the failures
    assert [o.error_kind for o in outcomes] == [kind for _, kind in flat]
    assert Counter(o.error_kind for o in outcomes if o.error_kind) == {k: len(v) for k, v in calls.items() if k}
    assert set(o.error_kind for o in outcomes if o.error_kind) == set(ERROR_KINDS)
    for outcome in outcomes:
        if outcome.error_kind:
            assert outcome.result is None and outcome.error and "\n" not in outcome.error and len(outcome.error) <= 300
    assert "boom second line" in outcomes[[raw for raw, _ in flat].index(call("broken"))].error
    assert again[0].result.text == "2"


def test_a_sleeping_tool_is_stopped_at_the_timeout(user_module, tmp_path):
    tools = build_tools(["sleepy"], user_module)
    pid_file = tmp_path / "pid"
    with ToolRunner(tools, max_workers=1, timeout_s=1.0) as runner:
        runner.run([(call("sleepy", seconds=0), ctx_for(coordinate_image()))])  # start the worker first
        start = time.monotonic()
        (outcome,) = runner.run([(call("sleepy", seconds=120, pid_file=str(pid_file)), ctx_for(coordinate_image()))])
        elapsed = time.monotonic() - start
        pid = int(pid_file.read_text())
        assert outcome.error_kind == "timeout" and "1 s" in outcome.error
        assert 1.0 <= elapsed < 5.0
        with pytest.raises(ProcessLookupError):  # the worker that ran it is gone, not left sleeping
            os.kill(pid, 0)
        (after,) = runner.run([(call("sleepy", seconds=0), ctx_for(coordinate_image()))])
        assert after.result.text == "awake" and runner.workers_started == 2


def test_submit_returns_at_once_and_its_futures_give_runs_outcomes(user_module, tmp_path):
    """`submit` starts the calls and returns their futures before they finish; each gives what `run` gives, and a
    call past the timeout is stopped (its worker killed) even when its future is read long after."""
    tools = build_tools(["sleepy", "calculator", "broken"], user_module)
    ctx = ctx_for(coordinate_image())
    pid_file = tmp_path / "pid"
    calls = [(call("sleepy", seconds=120, pid_file=str(pid_file)), ctx), (call("sleepy", seconds=0.3), ctx),
             (call("calculator", expression="6 * 7"), ctx), (call("broken"), ctx), ("{", ctx)]
    with ToolRunner(tools, max_workers=5, timeout_s=1.0) as runner:
        runner.run([(call("sleepy", seconds=0), ctx)] * 5)  # start the workers first
        start = time.monotonic()
        futures = runner.submit(calls)
        assert time.monotonic() - start < 0.2 and not futures[0].done() and not futures[1].done()
        time.sleep(2.0)  # past the timeout before anyone reads the futures
        assert all(f.done() for f in futures)
        submitted = [f.result() for f in futures]
        with pytest.raises(ProcessLookupError):  # the timed-out call's worker is gone, not left sleeping
            os.kill(int(pid_file.read_text()), 0)
        ran = runner.run(calls[1:])
    assert submitted[0].error_kind == "timeout" and "1 s" in submitted[0].error and submitted[0].name == "sleepy"
    assert [(o.error_kind, o.error, o.result and o.result.text) for o in submitted[1:]] == \
        [(o.error_kind, o.error, o.result and o.result.text) for o in ran]
    assert submitted[1].result.text == "awake" and submitted[2].result.text == "42"
    assert [o.error_kind for o in submitted[3:]] == ["tool_exception", "malformed_json"]


def test_workers_see_the_right_images_across_calls(user_module):
    """A worker keeps images it was sent and is later sent only their keys; past its cache size it
    drops the oldest. Every call must still see exactly its own images, in order."""
    images = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(50)]
    orders = [list(range(40)), [39, 0, 5], list(range(10, 50)), [0, 1, 2, 45, 3], list(range(49, -1, -1))]
    with ToolRunner(build_tools(["inspect"], user_module), max_workers=1, timeout_s=30) as runner:
        for order in orders:
            ctx = ToolContext(images=[images[i] for i in order], min_pixels=1, max_pixels=64)
            (outcome,) = runner.run([(call("inspect"), ctx)])
            assert outcome.result.text == " ".join(map(str, order))


def test_calculator_evaluates_and_refuses():
    assert evaluate_arithmetic("1 + 2 * 3") == 7
    assert evaluate_arithmetic("-(2 ** 3) % 5") == 2
    assert evaluate_arithmetic("7 / 2") == 3.5
    assert Calculator()({"expression": "0.1 * 3"}, ctx_for(coordinate_image())).text == "0.3"
    for expression, words in [("x + 1", "Name"), ("abs(-1)", "Call"), ("(1).real", "Attribute"),
                              ("9 ** 9 ** 9", "exponent"), ("10 ** 61", "larger"), ("2 ** 200", "larger"),
                              ("[1][0]", "not allowed"), ("1 / 0", "division by zero"), ("'a' * 3", "not allowed"),
                              ("1 +", "not an arithmetic"), ("1" * 300, "longer"), ("True + 1", "not allowed"),
                              ("(-8) ** 0.5", "real number"), ("1e308 * 10", "larger")]:
        with pytest.raises(ToolArgumentError, match=words):
            evaluate_arithmetic(expression)


def test_registry_errors(user_module):
    with pytest.raises(ValueError, match=r"rollout.tools: unknown tool\(s\) \['nope'\]"):
        build_tools(["nope"])
    with pytest.raises(ValueError, match="rollout.tools_module: cannot import 'no_such_tools_module'"):
        build_tools(["calculator"], "no_such_tools_module")

    class Other(Calculator):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_tool(Other())


def test_the_worker_pipe_carries_json_and_raw_bytes_only():
    """Calls and results cross the pipe as JSON plus raw image bytes; a model's arguments that look like the
    format's own markers arrive unchanged."""
    from rollout.tools import _HEADER, _decode, _encode
    message = ["ok", ["text", [["RGB", [2, 1], b"abcdef"]]], {"__blob__": 0, "n": 3}, {"__esc__": [1, {"__blob__": 1}]}]
    data = _encode(message)
    text_len, body_len = _HEADER.unpack_from(data)[0], _HEADER.unpack_from(data, _HEADER.size)[0]
    assert len(data) == 2 * _HEADER.size + text_len + body_len and body_len == 6
    text = data[2 * _HEADER.size: 2 * _HEADER.size + text_len]
    assert _decode(text, data[2 * _HEADER.size + text_len:]) == message
    json.loads(text)  # the header part is plain JSON
