"""CLEVR-like counting scenes rendered with PIL, in the clevr_count_70k row schema.

A scene is a flat background with circles, squares and triangles in several colours and
two sizes, placed so that no object hides another. Each row asks one counting question
(all objects, one colour, one shape, or a colour+shape pair) whose integer answer is
computed from the objects actually drawn. Row i depends only on (seed, i), never on n or
on global random state, so the same seed always gives byte-identical rows.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (210, 45, 45),
    "green": (45, 160, 70),
    "blue": (50, 90, 215),
    "yellow": (230, 200, 40),
    "purple": (135, 65, 185),
    "cyan": (40, 190, 200),
    "gray": (120, 120, 120),
    "brown": (135, 85, 40),
}
SHAPES = ("circle", "square", "triangle")
# Object radius as a fraction of the image's shorter side.
SIZES = {"small": 0.065, "large": 0.1}
QUESTION_KINDS = ("all", "color", "shape", "color_shape")
BACKGROUND = (222, 222, 216)
SUPERSAMPLE = 2  # draw at 2x and downsample: PIL's primitives are not antialiased
# Bounding-circle radius relative to r (a square's corners reach r*sqrt(2)*0.8).
_EXTENT = {"circle": 1.0, "square": 1.14, "triangle": 1.0}
# Bounding circles may overlap by this fraction of their summed radii: shapes then touch
# at most at corners, and no object is ever fully hidden.
_MAX_OVERLAP = 0.1
_PLACEMENT_TRIES = 200


@dataclass(frozen=True)
class SceneObject:
    """One drawn object, in output-pixel coordinates."""

    shape: str
    color: str
    size: str
    x: float
    y: float
    r: float

    @property
    def extent(self) -> float:
        return self.r * _EXTENT[self.shape]


def _fits(candidate: SceneObject, placed: list[SceneObject]) -> bool:
    for other in placed:
        limit = (1.0 - _MAX_OVERLAP) * (candidate.extent + other.extent)
        if math.hypot(candidate.x - other.x, candidate.y - other.y) < limit:
            return False
    return True


def _try_place(rng: random.Random, shape: str, color: str, size: str, width: int, height: int,
               placed: list[SceneObject], scale: float = 1.0) -> SceneObject | None:
    r = SIZES[size] * min(width, height) * scale
    margin = r * _EXTENT[shape] + 1
    for _ in range(_PLACEMENT_TRIES):
        obj = SceneObject(shape, color, size, rng.uniform(margin, width - margin),
                          rng.uniform(margin, height - margin), r)
        if _fits(obj, placed):
            return obj
    return None


def sample_scene(rng: random.Random, n_objects: int, width: int, height: int,
                 scale: float = 1.0, shapes: tuple[str, ...] = SHAPES,
                 sizes: tuple[str, ...] = tuple(SIZES),
                 colors: tuple[str, ...] = tuple(COLORS)) -> list[SceneObject]:
    """Place up to `n_objects` random objects without occlusion.

    An object that finds no free spot is retried small and then dropped, so a crowded
    scene may hold fewer objects than asked; answers are always counted from the result.
    """
    placed: list[SceneObject] = []
    for _ in range(n_objects):
        shape, color = rng.choice(list(shapes)), rng.choice(list(colors))
        size = rng.choice(list(sizes))
        obj = _try_place(rng, shape, color, size, width, height, placed, scale)
        if obj is None and size != "small" and "small" in sizes:
            obj = _try_place(rng, shape, color, "small", width, height, placed, scale)
        if obj is not None:
            placed.append(obj)
    return placed


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    s = SUPERSAMPLE
    x, y, r = obj.x * s, obj.y * s, obj.r * s
    fill = COLORS[obj.color]
    outline = tuple(max(0, c - 60) for c in fill)
    if obj.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill, outline=outline, width=s)
    elif obj.shape == "square":
        half = 0.8 * r
        draw.rectangle((x - half, y - half, x + half, y + half), fill=fill, outline=outline, width=s)
    else:
        points = [(x + r * math.cos(a), y - r * math.sin(a))
                  for a in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)]
        draw.polygon(points, fill=fill, outline=outline, width=s)


def render_scene(objects: list[SceneObject], width: int, height: int) -> bytes:
    """Draw the objects on a flat background and return PNG bytes."""
    canvas = Image.new("RGB", (width * SUPERSAMPLE, height * SUPERSAMPLE), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        _draw_object(draw, obj)
    image = canvas.reduce(SUPERSAMPLE)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _pick(rng: random.Random, present: list[str], every: list[str]) -> str:
    # Mostly ask about something in the scene, sometimes about anything (answer may be 0).
    if present and rng.random() < 0.75:
        return rng.choice(sorted(set(present)))
    return rng.choice(every)


def make_question(rng: random.Random, objects: list[SceneObject], kind: str) -> tuple[str, int]:
    """A counting question of the given kind about `objects` and its integer answer."""
    if kind == "all":
        return "How many objects are there?", len(objects)
    if kind == "color":
        color = _pick(rng, [o.color for o in objects], list(COLORS))
        return f"How many {color} objects are there?", sum(o.color == color for o in objects)
    if kind == "shape":
        shape = _pick(rng, [o.shape for o in objects], list(SHAPES))
        return f"How many {shape}s are there?", sum(o.shape == shape for o in objects)
    if kind == "color_shape":
        target = _pick(rng, [f"{o.color} {o.shape}" for o in objects],
                       [f"{c} {s}" for c in COLORS for s in SHAPES])
        color, shape = target.split(" ")
        count = sum(o.color == color and o.shape == shape for o in objects)
        return f"How many {color} {shape}s are there?", count
    raise ValueError(f"unknown question kind {kind!r}; known kinds: {', '.join(QUESTION_KINDS)}")


def _check_args(size, min_objects, max_objects, question_kinds) -> None:
    width, height = size
    if width < 16 or height < 16:
        raise ValueError(f"size must be at least 16x16, got {width}x{height}")
    if not 0 <= min_objects <= max_objects:
        raise ValueError(f"need 0 <= min_objects <= max_objects, got {min_objects}, {max_objects}")
    unknown = [k for k in question_kinds if k not in QUESTION_KINDS]
    if unknown or not question_kinds:
        raise ValueError(f"bad question_kinds {question_kinds!r}; known kinds: {', '.join(QUESTION_KINDS)}")


def generate(
    n: int,
    seed: int,
    *,
    size: tuple[int, int] = (112, 112),
    min_objects: int = 1,
    max_objects: int = 10,
    question_kinds: tuple[str, ...] = ("all", "color", "shape"),
    count_range: tuple[int, int] | None = None,
    object_scale: float = 1.0,
    shapes: tuple[str, ...] = SHAPES,
    sizes: tuple[str, ...] = tuple(SIZES),
    colors: tuple[str, ...] = tuple(COLORS),
) -> list[dict]:
    """`n` counting rows {"images": [{"bytes", "path"}], "problem", "answer"}.

    `count_range=(lo, hi)` is a shorthand for min_objects=lo, max_objects=hi (e.g. (1, 6)
    for an easy demo). `object_scale` multiplies object sizes (larger objects are easier to
    count for a small vision tower); `shapes`, `sizes` and `colors` restrict the objects drawn (one shape
    and one size make the count proportional to the painted area: the easiest setting). The answer is the count as a decimal string; colour and shape
    questions can have answer "0".
    """
    if count_range is not None:
        min_objects, max_objects = count_range
    _check_args(size, min_objects, max_objects, question_kinds)
    width, height = size
    rows = []
    for i in range(n):
        # String seeds hash with SHA-512 inside random.Random: stable across runs and
        # processes, and row i does not depend on how many rows are generated.
        rng = random.Random(f"clevr:{seed}:{i}")
        objects = sample_scene(rng, rng.randint(min_objects, max_objects), width, height, object_scale,
                               tuple(shapes), tuple(sizes), tuple(colors))
        question, answer = make_question(rng, objects, rng.choice(list(question_kinds)))
        rows.append({
            "images": [{"bytes": render_scene(objects, width, height), "path": f"clevr_{i}.png"}],
            "problem": f"<image>{question}",
            "answer": str(answer),
        })
    return rows
