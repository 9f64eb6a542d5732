"""Tools an agentic episode can call, and the runner that calls them.

A tool has a `name`, a `description`, a JSON-schema `parameters` object and
`__call__(arguments, ctx) -> ToolResult` (text and/or RGB images). Tools live in one registry:
the built-ins (`image_zoom_in_tool`, `calculator`) register when this module is imported, and
`build_tools(names, user_module)` imports `user_module` first, so a user's module registers its
own tools with `register_tool`. Importing that module runs the user's code, in the trainer and in
every tool worker.

`ToolRunner.run` takes the raw text the model wrote between the family's call markers, parses it
(JSON `{"name": ..., "arguments": {...}}`), checks the arguments against the tool's schema and
runs the call in a small pool of worker processes. It never raises for a bad call: each failure
becomes a `ToolOutcome` with one of five kinds and a one-line message for the model. A call that
runs past `timeout_s` is stopped: its worker process (and anything it started) is killed and a
fresh one takes its place, so a stuck tool never holds a worker or a CPU after its turn.
`ToolRunner.submit` starts the same calls and returns their futures at once, for a caller that goes
on while they run (continuous turns).

Workers are plain `python -c` subprocesses that import this module (not the trainer's main
script, as multiprocessing's spawn would), so one starts in about a tenth of a second; calls and
calls and results cross a pipe as length-prefixed JSON with the images' raw bytes after it (nothing is
unpickled). A worker finds its tools by importing the module of each tool's class, which registers it,
so a tool must be registered when its module is imported.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from PIL import Image

from data.zoom import BadBox, zoom

ERROR_KINDS = ("malformed_json", "unknown_tool", "bad_arguments", "tool_exception", "timeout")
MAX_ERROR_CHARS = 300
WORKER_START_TIMEOUT_S = 60.0


@dataclass
class ToolResult:
    """What a tool returns: text for the model and/or images (PIL, RGB) appended to the episode."""

    text: str = ""
    images: list = field(default_factory=list)


@dataclass
class ToolContext:
    """What a tool sees of its episode.

    `images` are the episode's images so far, in order (prompt images first), as the model saw
    them. A returned image is resized afterwards by the caller's image rule; a tool only
    guarantees that each image it returns has at most `max_pixels` pixels. The images are not
    changed once in a context (a tool worker keeps its copy of an image by the object's identity)."""

    images: list
    min_pixels: int
    max_pixels: int
    # The same images at the resolution the dataset holds them, where the caller has them (the
    # prompt's, from `EncodedPrompt.originals`); None or a missing entry: only the seen image exists.
    originals: list = field(default_factory=list)


class ToolArgumentError(ValueError):
    """Bad arguments to a tool; its message (one line) is what the model is shown."""


class Tool:
    """Base class for tools (duck-typing the same attributes works too)."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    def schema(self) -> dict:
        """The OpenAI function schema the chat template renders into the system prompt."""
        return tool_schema(self)

    def __call__(self, arguments: dict, ctx: ToolContext) -> ToolResult:
        raise NotImplementedError(f"tool {self.name!r} does not implement __call__")


def tool_schema(tool) -> dict:
    """{"type": "function", "function": {name, description, parameters}} for any tool object."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


@dataclass
class ToolOutcome:
    """One call's outcome: a result, or an error kind (see ERROR_KINDS) and a one-line message."""

    result: ToolResult | None
    error_kind: str | None
    error: str = ""
    name: str | None = None
    seconds: float = 0.0


# --- registry ------------------------------------------------------------------------------------

_REGISTRY: dict[str, object] = {}


def register_tool(tool):
    """Add `tool` to the registry under `tool.name` and return it (usable as a class decorator on an
    instance-producing class too: pass an instance). A name registered twice by different classes
    is refused; re-registering the same class (a module imported again) replaces the entry."""
    if isinstance(tool, type):
        tool = tool()
    _check_tool(tool)
    old = _REGISTRY.get(tool.name)
    if old is not None and type(old) is not type(tool):
        raise ValueError(f"tool name {tool.name!r} is already registered by {type(old).__qualname__}")
    _REGISTRY[tool.name] = tool
    return tool


def _check_tool(tool) -> None:
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name.replace("_", "a").replace("-", "a").isalnum():
        raise ValueError(f"a tool's name must be letters, digits, '_' or '-'; got {name!r} ({type(tool).__qualname__})")
    if not isinstance(getattr(tool, "description", None), str):
        raise ValueError(f"tool {name!r}: description must be a string")
    params = getattr(tool, "parameters", None)
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema dict with \"type\": \"object\"")
    if not callable(tool):
        raise ValueError(f"tool {name!r} is not callable")


def registered_tools() -> list[str]:
    return sorted(_REGISTRY)


def build_tools(names: list[str], user_module: str | None = None) -> dict[str, object]:
    """The tools named in `rollout.tools`, by name. `user_module` (rollout.tools_module) is imported
    first so that it can call `register_tool`; importing it runs the user's code."""
    if user_module:
        try:
            importlib.import_module(user_module)
        except ImportError as err:
            raise ValueError(f"rollout.tools_module: cannot import {user_module!r}: {err}") from err
    missing = [n for n in names if n not in _REGISTRY]
    if missing:
        raise ValueError(f"rollout.tools: unknown tool(s) {missing}; registered: {registered_tools()}"
                         + ("" if user_module else " (a user tool needs rollout.tools_module)"))
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.tools: a tool is named twice in {list(names)}")
    return {n: _REGISTRY[n] for n in names}


# --- argument checking ---------------------------------------------------------------------------

_JSON_TYPES = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def check_arguments(tool, arguments) -> None:
    """Check `arguments` against the tool's schema: an object, required keys present, no unknown
    keys, and each value of its declared top-level type (and array item type)."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    props = tool.parameters.get("properties", {})
    for key in tool.parameters.get("required", []):
        if key not in arguments:
            raise ToolArgumentError(f"missing argument {key!r}")
    for key, value in arguments.items():
        if key not in props:
            raise ToolArgumentError(f"unknown argument {key!r}; {tool.name} takes {sorted(props)}")
        _check_type(key, value, props[key])


def _check_type(key: str, value, spec: dict) -> None:
    kind = spec.get("type")
    if kind is None:
        return
    kinds = kind if isinstance(kind, list) else [kind]
    ok = any(isinstance(value, _JSON_TYPES.get(k, object)) and not (k in ("integer", "number") and isinstance(value, bool))
             for k in kinds)
    if not ok:
        raise ToolArgumentError(f"argument {key!r} must be {' or '.join(kinds)}, got {json.dumps(value)[:60]}")
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        for i, item in enumerate(value):
            _check_type(f"{key}[{i}]", item, spec["items"])


# --- built-in tools ------------------------------------------------------------------------------

class ImageZoomInTool(Tool):
    """DeepEyes's zoom tool: the box `bbox_2d` of the episode's first image, enlarged (data/zoom.py).

    The box is in pixel coordinates of the first image as the model saw it; the crop is cut from
    `ctx.originals[0]` when the episode has it (the image at the dataset's resolution), so zooming
    shows detail the model's view had lost."""

    name = "image_zoom_in_tool"
    description = ("Zoom in on a region of the image: crop the box bbox_2d = [x1, y1, x2, y2] (pixel "
                   "coordinates of the image) and return it enlarged.")
    parameters = {
        "type": "object",
        "properties": {
            "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                        "description": "the box [x1, y1, x2, y2] in pixels, x1 < x2, y1 < y2"},
            "label": {"type": "string", "description": "optional name of the object in the box"},
        },
        "required": ["bbox_2d"],
    }

    def __call__(self, arguments: dict, ctx: ToolContext) -> ToolResult:
        if not ctx.images:
            raise ToolArgumentError("the episode has no image to zoom into")
        original = ctx.originals[0] if ctx.originals else None
        try:
            return ToolResult(images=[zoom(ctx.images[0], arguments.get("bbox_2d"), ctx.max_pixels, original)])
        except BadBox as err:
            raise ToolArgumentError(str(err)) from None


MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 60


class Calculator(Tool):
    """A bounded arithmetic evaluator: numbers, + - * / // % **, unary +/- and parentheses.

    The expression is parsed with `ast` and only those nodes are walked; names, calls, attributes,
    subscripts and everything else are refused, and it is never passed to eval. Exponents are at
    most MAX_EXPONENT and every value at most MAX_MAGNITUDE, so no call can run long."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (3 + 4) * 2 ** 3"}},
        "required": ["expression"],
    }

    def __call__(self, arguments: dict, ctx: ToolContext) -> ToolResult:
        return ToolResult(text=format_number(evaluate_arithmetic(arguments["expression"])))


_BINOPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression`, or ToolArgumentError naming what was refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolArgumentError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise ToolArgumentError(f"not an arithmetic expression: {err.msg if isinstance(err, SyntaxError) else err}") from None
    return _eval(tree.body)


def _eval(node) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        try:
            return _bounded(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolArgumentError("division by zero") from None
    raise ToolArgumentError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise ToolArgumentError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ToolArgumentError("division by zero")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ToolArgumentError(f"result larger than 1e{round(math.log10(MAX_MAGNITUDE))}")
    result = base ** exponent
    if isinstance(result, complex):
        raise ToolArgumentError("a negative number to a fractional power is not a real number")
    return _bounded(result)


def _bounded(value):
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolArgumentError(f"result larger than 1e{round(math.log10(MAX_MAGNITUDE))}")
    return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


register_tool(ImageZoomInTool())
register_tool(Calculator())


# --- parsing a call ------------------------------------------------------------------------------

def one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def parse_call(raw: str, tools: dict) -> tuple[str, dict] | ToolOutcome:
    """(name, arguments) from the text between the call markers, or the failed ToolOutcome."""
    try:
        call = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as err:
        return ToolOutcome(None, "malformed_json", one_line(f"tool call is not valid JSON: {err}"))
    if isinstance(call, dict) and isinstance(call.get("malformed"), str) and "name" not in call:
        # a family whose calls are not JSON (Qwen3.5's XML) hands over what was wrong with one
        return ToolOutcome(None, "malformed_json", one_line(call["malformed"]))
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolOutcome(None, "malformed_json",
                           'tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in tools:
        return ToolOutcome(None, "unknown_tool", one_line(f"unknown tool {name!r}; available: {sorted(tools)}"),
                           name=name)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    try:
        check_arguments(tools[name], arguments)
    except ToolArgumentError as err:
        return ToolOutcome(None, "bad_arguments", one_line(f"{name}: {err}"), name=name)
    return name, arguments


# --- the worker process --------------------------------------------------------------------------

_HEADER = struct.Struct(">Q")


def _encode(obj) -> bytes:
    """One message: its JSON (each `bytes` value replaced by a reference) and then the bytes values,
    framed by the JSON's and the blobs' lengths. Tuples arrive as lists."""
    blobs: list[bytes] = []

    def strip(value):
        if isinstance(value, (bytes, bytearray)):
            blobs.append(bytes(value))
            return {"__blob__": len(blobs) - 1, "n": len(value)}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        if isinstance(value, dict):
            if "__blob__" in value or "__esc__" in value:  # a value that could be read as a marker
                return {"__esc__": [[k, strip(v)] for k, v in value.items()]}
            return {k: strip(v) for k, v in value.items()}
        return value

    text = json.dumps(strip(obj), separators=(",", ":")).encode()
    body = b"".join(blobs)
    return _HEADER.pack(len(text)) + _HEADER.pack(len(body)) + text + body


def _decode(text: bytes, body: bytes):
    """The inverse of `_encode` for one message's JSON and blobs."""
    offsets = []

    def restore(value):
        if isinstance(value, dict):
            if set(value) == {"__blob__", "n"}:  # blobs follow in the order the JSON names them
                start = offsets[-1] if offsets else 0
                offsets.append(start + value["n"])
                return body[start:start + value["n"]]
            if set(value) == {"__esc__"}:
                return {k: restore(v) for k, v in value["__esc__"]}
            return {k: restore(v) for k, v in value.items()}
        if isinstance(value, list):
            return [restore(v) for v in value]
        return value

    return restore(json.loads(text))


def _write_message(stream, obj) -> None:
    stream.write(_encode(obj))
    stream.flush()


def _read_message(stream):
    (text_len,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    (body_len,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return _decode(_read_exact(stream, text_len), _read_exact(stream, body_len))


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("pipe closed")
    return data


def _call_tool(tool, arguments: dict, ctx: ToolContext) -> tuple:
    """Run one call in the worker: ("ok", ToolResult) or (error_kind, message)."""
    try:
        result = tool(arguments, ctx)
        return "ok", normalize_result(result, ctx)
    except ToolArgumentError as err:
        return "bad_arguments", one_line(f"{tool.name}: {err}")
    except Exception as err:  # a tool's own failure is reported to the model, never raised
        return "tool_exception", one_line(f"{tool.name} raised {type(err).__name__}: {err}")


def normalize_result(result, ctx: ToolContext) -> ToolResult:
    """A ToolResult with RGB images of at most ctx.max_pixels (a str or an image alone is accepted)."""
    if isinstance(result, str):
        result = ToolResult(text=result)
    elif isinstance(result, Image.Image):
        result = ToolResult(images=[result])
    if not isinstance(result, ToolResult):
        raise TypeError(f"returned {type(result).__name__}, expected a ToolResult")
    if not isinstance(result.text, str) or not isinstance(result.images, list):
        raise TypeError("returned a ToolResult whose text is not a str or images not a list")
    images = []
    for image in result.images:
        if not isinstance(image, Image.Image):
            raise TypeError(f"returned an image of type {type(image).__name__}, expected a PIL image")
        if image.width * image.height > ctx.max_pixels:
            raise ValueError(f"returned a {image.width}x{image.height} image, above max_pixels={ctx.max_pixels}")
        images.append(image if image.mode == "RGB" else image.convert("RGB"))
    return ToolResult(text=result.text, images=images)


def _worker_main() -> None:
    """Serve calls on stdin/stdout until stdin closes. The tool's own prints go to stderr."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    try:
        tools = _import_tools(_read_message(requests))
    except Exception as err:
        _write_message(reply, ("start_error", one_line(f"{type(err).__name__}: {err}")))
        return
    _write_message(reply, ("ready", os.getpid()))
    cache = _WorkerImages()
    while True:
        try:
            name, arguments, ctx = _read_message(requests)
        except EOFError:
            return
        outcome = _call_tool(tools[name], arguments, cache.context(ctx))
        if outcome[0] == "ok":
            outcome = ("ok", (outcome[1].text, [_pack_image(im) for im in outcome[1].images]))
        _write_message(reply, outcome)


def _widen_pipe(fd: int) -> None:
    # A 64 KiB pipe moves a 448x448 image in ten wake-ups of each side; 1 MiB (Linux's default
    # limit for unprivileged processes) moves it in one.
    try:
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


def _pack_image(image: Image.Image) -> tuple:
    # PIL's own pickling is ten times slower than its raw bytes (8 ms against 0.8 ms at 448x448).
    return image.mode, image.size, image.tobytes()


def _unpack_image(packed) -> Image.Image:
    mode, size, data = packed
    return Image.frombytes(mode, tuple(size), data)


class _WorkerImages:
    """The worker's copies of episode images. The parent sends an image once per worker (its
    prompt image serves every episode of a group and every turn) and then refers to it by key;
    it also says which keys to drop, so both sides hold the same set."""

    def __init__(self):
        self.images: dict[int, Image.Image] = {}

    def context(self, wire: tuple) -> ToolContext:
        images, n_seen, original_flags, min_pixels, max_pixels, evict = wire
        resolved = []
        for item in images:
            if len(item) == 2:
                self.images[item[0]] = _unpack_image(item[1])
            resolved.append(self.images[item[0]])
        for key in evict:  # after resolving: the parent may drop a key this same call refers to
            self.images.pop(key, None)
        present = iter(resolved[n_seen:])
        originals = [next(present) if flag else None for flag in original_flags]
        return ToolContext(resolved[:n_seen], min_pixels, max_pixels, originals)


WORKER_IMAGE_CACHE = 32


class _Worker:
    """One tool worker process (in its own process group, so killing it kills what it started)."""

    def __init__(self, payload: bytes):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rollout.tools import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._buffer = b""
        for stream in (self.proc.stdin, self.proc.stdout):
            _widen_pipe(stream.fileno())
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()
        reply = self.receive(time.monotonic() + WORKER_START_TIMEOUT_S)
        if reply is None or reply[0] != "ready":
            self.kill()
            raise RuntimeError(f"a tool worker failed to start: {reply[1] if reply else 'timed out'}")
        self.pid = reply[1]
        self._sent: dict[int, Image.Image] = {}  # id -> image; holding the image keeps its id unique

    def wire_context(self, ctx: ToolContext) -> tuple:
        """ctx with each image the worker already holds replaced by its key."""
        images, evict = [], []
        originals = [im for im in (ctx.originals or []) if im is not None]
        for image in [*ctx.images, *originals]:
            key = id(image)
            if key in self._sent:
                self._sent[key] = self._sent.pop(key)  # most recently used last
                images.append((key,))
                continue
            if len(self._sent) >= WORKER_IMAGE_CACHE:
                old = next(iter(self._sent))
                del self._sent[old]
                evict.append(old)
            self._sent[key] = image
            images.append((key, _pack_image(image)))
        flags = [im is not None for im in (ctx.originals or [])]
        return images, len(ctx.images), flags, ctx.min_pixels, ctx.max_pixels, evict

    def send(self, obj) -> None:
        _write_message(self.proc.stdin, obj)

    def receive(self, deadline: float):
        """The next reply, None past `deadline`; EOFError if the worker died."""
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buffer) >= 2 * _HEADER.size:
                (text_len,) = _HEADER.unpack_from(self._buffer)
                (body_len,) = _HEADER.unpack_from(self._buffer, _HEADER.size)
                end = 2 * _HEADER.size + text_len + body_len
                if len(self._buffer) >= end:
                    text = self._buffer[2 * _HEADER.size: 2 * _HEADER.size + text_len]
                    body = self._buffer[2 * _HEADER.size + text_len: end]
                    self._buffer = self._buffer[end:]
                    return _decode(text, body)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError("tool worker exited")
                self._buffer += chunk

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _worker_payload(tools: dict) -> bytes:
    """The first message a worker reads: each tool's name and the module of its class. The worker
    imports those modules, which register the tools, so a tool must be registered at import time and
    a class defined in a script run as __main__ cannot be used."""
    for name, tool in tools.items():
        if type(tool).__module__ == "__main__":
            raise ValueError(f"rollout.tools: tool {name!r} is defined in the __main__ script; define it in a "
                             f"module named by rollout.tools_module so the tool workers can import it")
    return _encode({name: [type(tool).__module__, type(tool).__qualname__] for name, tool in tools.items()})


def _import_tools(modules: dict) -> dict:
    """In a worker: the tools of `_worker_payload`, found in the registry once their modules are imported."""
    tools = {}
    for name, (module, qualname) in modules.items():
        importlib.import_module(module)
        tool = _REGISTRY.get(name)
        if tool is None or type(tool).__qualname__ != qualname:
            raise ValueError(f"tool {name!r} ({module}.{qualname}) is not registered when {module} is imported; "
                             f"call register_tool at the module's top level")
        tools[name] = tool
    return tools


class ToolRunner:
    """Runs tool calls in at most `max_workers` worker processes; a call past `timeout_s` is
    stopped (its worker killed and replaced). `run` never raises for a bad call; `submit` starts the
    same calls and returns their futures."""

    def __init__(self, tools: dict, max_workers: int = 4, timeout_s: float = 10.0):
        if max_workers < 1:
            raise ValueError(f"rollout.tool_workers must be at least 1, got {max_workers}")
        if not timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s must be positive, got {timeout_s}")
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)
        self._payload = _worker_payload(self.tools)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")
        self.workers_started = 0

    def run(self, calls: list[tuple[str, ToolContext]]) -> list[ToolOutcome]:
        """One outcome per (raw call text, context), in order."""
        return [f.result() for f in self.submit(calls)]

    def submit(self, calls: list[tuple[str, ToolContext]]) -> list[Future]:
        """`run` without waiting: one future per (raw call text, context), in order, each giving the call's
        ToolOutcome. A call's timeout runs from when a pool thread sends it to a worker, which that thread
        kills at the timeout whether or not anyone is waiting on the future, so collecting the outcomes
        late changes none of them."""
        return [self._pool.submit(self._run_one, raw, ctx) for raw, ctx in calls]

    def _run_one(self, raw: str, ctx: ToolContext) -> ToolOutcome:
        start = time.monotonic()
        parsed = parse_call(raw, self.tools)
        if isinstance(parsed, ToolOutcome):
            return parsed
        name, arguments = parsed
        try:
            outcome = self._dispatch(name, arguments, ctx)
        except Exception as err:  # the pool itself failing (cannot start a worker) is the tool's failure
            outcome = ToolOutcome(None, "tool_exception", one_line(f"{name}: {err}"))
        outcome.name = name
        outcome.seconds = time.monotonic() - start
        return outcome

    def _dispatch(self, name: str, arguments: dict, ctx: ToolContext) -> ToolOutcome:
        worker = self._acquire()
        try:
            worker.send((name, arguments, worker.wire_context(ctx)))
            reply = worker.receive(time.monotonic() + self.timeout_s)
        except (EOFError, OSError):
            worker.kill()
            return ToolOutcome(None, "tool_exception", f"{name}: the tool's worker process exited during the call")
        if reply is None:
            worker.kill()
            return ToolOutcome(None, "timeout", f"{name}: stopped after {self.timeout_s:g} s without a result")
        self._release(worker)
        if reply[0] == "ok":
            text, images = reply[1]
            return ToolOutcome(ToolResult(text=text, images=[_unpack_image(im) for im in images]), None)
        return ToolOutcome(None, reply[0], reply[1])

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.workers_started += 1
        return _Worker(self._payload)

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def close(self) -> None:
        """Stop the pool and its worker processes."""
        self._pool.shutdown(wait=True)
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
