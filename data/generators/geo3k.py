"""Geometry3K-like problems: labelled figures drawn with PIL, answers computed exactly.

Each figure is drawn from the values its labels show (a 3-4-5 triangle looks like one)
and the answer is computed from the same values, then written the way Geometry3K writes
answers: integers "12", rounded decimals "25.1", fractions "\\frac{7}{2}", radicals
"2\\sqrt{3}", angles in degrees without the sign "60". Row i depends only on (seed, i).

Each problem kind is a public function taking the figure's values, so a known case can
be built directly (e.g. `pythagoras(2, 4)` asks for a hypotenuse of 2\\sqrt{5}).
"""

from __future__ import annotations

import functools
import io
import math
import random
from fractions import Fraction
from typing import Callable, Sequence

from PIL import Image, ImageDraw, ImageFont

Point = tuple[float, float]
Problem = tuple[bytes, str, str]  # (PNG bytes, question without the <image> tag, answer)

SUPERSAMPLE = 2
INK = 20
BACKGROUND = 255


# --------------------------------------------------------------------- answer formats

def radical_text(n: int) -> str:
    """sqrt(n) in simplest radical form: 16 -> "4", 12 -> "2\\sqrt{3}", 5 -> "\\sqrt{5}"."""
    if n < 0:
        raise ValueError(f"no real square root of {n}")
    outside, inside = 1, n
    factor = 2
    while factor * factor <= inside:
        while inside % (factor * factor) == 0:
            inside //= factor * factor
            outside *= factor
        factor += 1
    if inside == 1 or n == 0:
        return str(outside if n else 0)
    return f"\\sqrt{{{inside}}}" if outside == 1 else f"{outside}\\sqrt{{{inside}}}"


def fraction_text(value: Fraction) -> str:
    """An exact rational as "7" or "\\frac{7}{2}" (sign in front: "-\\frac{1}{3}")."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def tenth_text(value: float) -> str:
    """A value rounded to the nearest tenth, as Geometry3K writes it: "25.1"."""
    return f"{value:.1f}"


# --------------------------------------------------------------------------- drawing

@functools.lru_cache(maxsize=8)
def _font(size_px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    # Loading the bundled font parses it from bytes; once per size is enough.
    return ImageFont.load_default(size=size_px)


class Canvas:
    """A figure's world coordinates (y up) fitted into an image (y down), drawn at 2x."""

    def __init__(self, size: tuple[int, int], points: Sequence[Point], margin: float = 0.2):
        self.width, self.height = size
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        span_x, span_y = max(max(xs) - min(xs), 1e-9), max(max(ys) - min(ys), 1e-9)
        self.scale = min(self.width * (1 - 2 * margin) / span_x, self.height * (1 - 2 * margin) / span_y)
        self.offset_x = (self.width - self.scale * span_x) / 2 - self.scale * min(xs)
        self.offset_y = (self.height - self.scale * span_y) / 2 + self.scale * max(ys)
        # Figures are black on white: drawing in one channel is a third of the work.
        self.image = Image.new("L", (self.width * SUPERSAMPLE, self.height * SUPERSAMPLE), BACKGROUND)
        self.draw = ImageDraw.Draw(self.image)
        font_px = max(9, round(min(self.width, self.height) / 17))
        self.font = _font(font_px * SUPERSAMPLE)
        self.line_width = max(1, round(min(self.width, self.height) / 110)) * SUPERSAMPLE

    def px(self, p: Point) -> Point:
        """World point -> supersampled pixel."""
        return ((self.offset_x + self.scale * p[0]) * SUPERSAMPLE, (self.offset_y - self.scale * p[1]) * SUPERSAMPLE)

    def line(self, p: Point, q: Point) -> None:
        self.draw.line([self.px(p), self.px(q)], fill=INK, width=self.line_width)

    def dashed(self, p: Point, q: Point, dash_px: float = 4.0) -> None:
        (x0, y0), (x1, y1) = self.px(p), self.px(q)
        length = math.hypot(x1 - x0, y1 - y0)
        steps = max(1, int(length / (dash_px * SUPERSAMPLE)))
        for k in range(0, steps, 2):
            a, b = k / steps, min(1.0, (k + 1) / steps)
            self.draw.line([(x0 + a * (x1 - x0), y0 + a * (y1 - y0)), (x0 + b * (x1 - x0), y0 + b * (y1 - y0))],
                           fill=INK, width=max(1, self.line_width // 2))

    def polygon(self, points: Sequence[Point]) -> None:
        for p, q in zip(points, list(points[1:]) + [points[0]]):
            self.line(p, q)

    def circle(self, center: Point, radius: float) -> None:
        x, y = self.px(center)
        r = radius * self.scale * SUPERSAMPLE
        self.draw.ellipse((x - r, y - r, x + r, y + r), outline=INK, width=self.line_width)

    def dot(self, p: Point) -> None:
        x, y = self.px(p)
        r = 1.5 * self.line_width
        self.draw.ellipse((x - r, y - r, x + r, y + r), fill=INK)

    def text(self, label: str, at: Point, toward: Point | None = None, away: Point | None = None,
             distance: float = 11.0) -> None:
        """Draw `label` centred near world point `at`, pushed `distance` output pixels
        toward (or away from) another world point; kept inside the image."""
        x, y = self.px(at)
        ref = toward if toward is not None else away
        if ref is not None:
            rx, ry = self.px(ref)
            dx, dy = rx - x, ry - y
            norm = math.hypot(dx, dy) or 1.0
            sign = 1.0 if toward is not None else -1.0
            x += sign * dx / norm * distance * SUPERSAMPLE
            y += sign * dy / norm * distance * SUPERSAMPLE
        left, top, right, bottom = self.draw.textbbox((0, 0), label, font=self.font)
        w, h = right - left, bottom - top
        x = min(max(x - w / 2, 1), self.image.width - w - 1)
        y = min(max(y - h / 2, 1), self.image.height - h - 1)
        self.draw.text((x - left, y - top), label, fill=INK, font=self.font)

    def right_angle(self, vertex: Point, a: Point, b: Point, size_px: float = 7.0) -> None:
        """The small square marking a right angle at `vertex` between rays to a and b."""
        def unit(p: Point) -> Point:
            d = math.hypot(p[0] - vertex[0], p[1] - vertex[1])
            return ((p[0] - vertex[0]) / d, (p[1] - vertex[1]) / d)
        s = size_px / self.scale
        (ux, uy), (vx, vy) = unit(a), unit(b)
        p1 = (vertex[0] + s * ux, vertex[1] + s * uy)
        p2 = (p1[0] + s * vx, p1[1] + s * vy)
        p3 = (vertex[0] + s * vx, vertex[1] + s * vy)
        self.draw.line([self.px(p1), self.px(p2), self.px(p3)], fill=INK, width=max(1, self.line_width // 2))

    def tick(self, p: Point, q: Point, count: int = 1, size_px: float = 5.0) -> None:
        """Congruence tick marks across the middle of segment pq."""
        (x0, y0), (x1, y1) = self.px(p), self.px(q)
        length = math.hypot(x1 - x0, y1 - y0)
        ux, uy = (x1 - x0) / length, (y1 - y0) / length
        nx, ny = -uy * size_px * SUPERSAMPLE, ux * size_px * SUPERSAMPLE
        for k in range(count):
            shift = (k - (count - 1) / 2) * 4 * SUPERSAMPLE
            cx, cy = (x0 + x1) / 2 + ux * shift, (y0 + y1) / 2 + uy * shift
            self.draw.line([(cx - nx, cy - ny), (cx + nx, cy + ny)], fill=INK, width=max(1, self.line_width // 2))

    def png(self) -> bytes:
        """Downsample (box filter: antialiases the strokes) and encode as an RGB PNG."""
        image = self.image.reduce(SUPERSAMPLE).convert("RGB")
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()


def _centroid(points: Sequence[Point]) -> Point:
    return (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points))


def _mid(p: Point, q: Point) -> Point:
    return ((p[0] + q[0]) / 2, (p[1] + q[1]) / 2)


def _polar(angle_deg: float, length: float, origin: Point = (0.0, 0.0)) -> Point:
    a = math.radians(angle_deg)
    return (origin[0] + length * math.cos(a), origin[1] + length * math.sin(a))


def _side_label(canvas: Canvas, label: str, p: Point, q: Point, inside: Point) -> None:
    canvas.text(label, _mid(p, q), away=inside, distance=10)


def _angle_label(canvas: Canvas, label: str, vertex: Point, ends: tuple[Point, Point]) -> None:
    """Label the angle at `vertex` between rays to `ends`, inside it along its bisector,
    farther out for narrow angles so the text clears both sides."""
    units = []
    for end in ends:
        d = math.hypot(end[0] - vertex[0], end[1] - vertex[1])
        units.append(((end[0] - vertex[0]) / d, (end[1] - vertex[1]) / d))
    bisector = (vertex[0] + units[0][0] + units[1][0], vertex[1] + units[0][1] + units[1][1])
    cos_angle = max(-1.0, min(1.0, units[0][0] * units[1][0] + units[0][1] * units[1][1]))
    half = math.acos(cos_angle) / 2
    distance = min(40.0, max(15.0, 9.0 / max(math.sin(half), 1e-3)))
    canvas.text(label, vertex, toward=bisector, distance=distance)


# ------------------------------------------------------------------ problem kinds

def pythagoras(leg_a: int, leg_b: int, *, size: tuple[int, int] = (224, 224)) -> Problem:
    """Right triangle with legs a (horizontal) and b (vertical) labelled; x = sqrt(a^2 + b^2)."""
    corner, right, top = (0.0, 0.0), (float(leg_a), 0.0), (0.0, float(leg_b))
    canvas = Canvas(size, [corner, right, top])
    canvas.polygon([corner, right, top])
    canvas.right_angle(corner, right, top)
    inside = _centroid([corner, right, top])
    _side_label(canvas, str(leg_a), corner, right, inside)
    _side_label(canvas, str(leg_b), corner, top, inside)
    _side_label(canvas, "x", right, top, inside)
    return canvas.png(), "Find x.", radical_text(leg_a * leg_a + leg_b * leg_b)


def pythagoras_leg(hypotenuse: int, leg: int, *, size: tuple[int, int] = (224, 224)) -> Problem:
    """Right triangle with the hypotenuse and one leg labelled; x = sqrt(c^2 - a^2)."""
    if not 0 < leg < hypotenuse:
        raise ValueError(f"need 0 < leg < hypotenuse, got leg={leg}, hypotenuse={hypotenuse}")
    other = math.sqrt(hypotenuse * hypotenuse - leg * leg)
    corner, right, top = (0.0, 0.0), (float(leg), 0.0), (0.0, other)
    canvas = Canvas(size, [corner, right, top])
    canvas.polygon([corner, right, top])
    canvas.right_angle(corner, right, top)
    inside = _centroid([corner, right, top])
    _side_label(canvas, str(leg), corner, right, inside)
    _side_label(canvas, "x", corner, top, inside)
    _side_label(canvas, str(hypotenuse), right, top, inside)
    return canvas.png(), "Find x.", radical_text(hypotenuse * hypotenuse - leg * leg)


def triangle_angles(angle_a: int, angle_b: int, *, size: tuple[int, int] = (224, 224)) -> Problem:
    """Triangle with two angles labelled in degrees; x is the third (180 - a - b)."""
    angle_c = 180 - angle_a - angle_b
    if min(angle_a, angle_b, angle_c) <= 0:
        raise ValueError(f"angles {angle_a}, {angle_b} leave no room for a third")
    # Law of sines with unit base: the apex sits where rays from both base ends meet.
    a_pt, b_pt = (0.0, 0.0), (1.0, 0.0)
    side_ac = math.sin(math.radians(angle_b)) / math.sin(math.radians(angle_c))
    c_pt = _polar(angle_a, side_ac, a_pt)
    canvas = Canvas(size, [a_pt, b_pt, c_pt])
    canvas.polygon([a_pt, b_pt, c_pt])
    _angle_label(canvas, f"{angle_a}°", a_pt, (b_pt, c_pt))
    _angle_label(canvas, f"{angle_b}°", b_pt, (a_pt, c_pt))
    _angle_label(canvas, "x°", c_pt, (a_pt, b_pt))
    return canvas.png(), "Find x.", str(angle_c)


def circle(radius: int, *, ask: str = "area", labelled: str = "radius",
           size: tuple[int, int] = (224, 224)) -> Problem:
    """Circle with its radius (or diameter) labelled; area or circumference to a tenth."""
    center = (0.0, 0.0)
    canvas = Canvas(size, [(-radius, -radius), (radius, radius)], margin=0.15)
    canvas.circle(center, radius)
    canvas.dot(center)
    if labelled == "radius":
        end = _polar(20, radius)
        canvas.line(center, end)
        canvas.text(str(radius), _mid(center, end), toward=(0.0, radius), distance=9)
    elif labelled == "diameter":
        start, end = _polar(200, radius), _polar(20, radius)
        canvas.line(start, end)
        canvas.text(str(2 * radius), _mid(center, end), toward=(0.0, radius), distance=9)
    else:
        raise ValueError(f"labelled must be 'radius' or 'diameter', got {labelled!r}")
    if ask == "area":
        return canvas.png(), "Find the area of the circle. Round to the nearest tenth.", tenth_text(math.pi * radius**2)
    if ask == "circumference":
        return (canvas.png(), "Find the circumference of the circle. Round to the nearest tenth.",
                tenth_text(2 * math.pi * radius))
    raise ValueError(f"ask must be 'area' or 'circumference', got {ask!r}")


def rectangle(width: int, height: int, *, ask: str = "area", size: tuple[int, int] = (224, 224)) -> Problem:
    """Rectangle with both sides labelled; area, perimeter, or the diagonal x."""
    corners = [(0.0, 0.0), (float(width), 0.0), (float(width), float(height)), (0.0, float(height))]
    canvas = Canvas(size, corners)
    canvas.polygon(corners)
    for k in range(4):
        canvas.right_angle(corners[k], corners[k - 1], corners[(k + 1) % 4])
    inside = _centroid(corners)
    _side_label(canvas, str(width), corners[0], corners[1], inside)
    _side_label(canvas, str(height), corners[1], corners[2], inside)
    if ask == "area":
        return canvas.png(), "Find the area of the rectangle.", str(width * height)
    if ask == "perimeter":
        return canvas.png(), "Find the perimeter of the rectangle.", str(2 * (width + height))
    if ask == "diagonal":
        canvas.line(corners[0], corners[2])
        canvas.text("x", _mid(corners[0], corners[2]), toward=corners[3], distance=9)
        return canvas.png(), "Find x.", radical_text(width * width + height * height)
    raise ValueError(f"ask must be 'area', 'perimeter' or 'diagonal', got {ask!r}")


# Angle positions at a line/transversal crossing, by the bisector direction offset.
# With the transversal rising at theta, "upper_right" and "lower_left" measure theta and
# the other two 180 - theta, at both crossings (the lines are parallel).
ANGLE_POSITIONS = ("upper_right", "upper_left", "lower_left", "lower_right")


def _position_angle(position: str, theta: int) -> int:
    return theta if position in ("upper_right", "lower_left") else 180 - theta


def _position_bisector(position: str, theta: int) -> float:
    start = {"upper_right": 0, "upper_left": theta, "lower_left": 180, "lower_right": 180 + theta}[position]
    return start + _position_angle(position, theta) / 2


def _label_spot(position: str, theta: int, crossing: Point, clearance: float = 0.22) -> Point:
    # Along the angle's bisector, far enough out that a label clears both lines even
    # for a narrow angle.
    half = math.radians(_position_angle(position, theta) / 2)
    distance = min(1.1, max(0.3, clearance / math.sin(half)))
    return _polar(_position_bisector(position, theta), distance, crossing)


def parallel_lines(theta: int, known: str, unknown: str, *, coefficient: int = 1, constant: int = 0,
                   size: tuple[int, int] = (224, 224)) -> Problem:
    """Two parallel lines cut by a transversal rising at `theta` degrees.

    The angle at position `known` on the upper line is labelled with its value; the angle
    at position `unknown` on the lower line is labelled "x°" or, with coefficient != 1 or
    constant != 0, "(coefficient x + constant)°". The answer solves that label = the
    angle's true measure, as an integer or fraction.
    """
    if not 0 < theta < 180 or theta == 90:
        raise ValueError(f"theta must be in (0, 180) and not 90, got {theta}")
    gap = 1.0
    top, bottom = (0.0, gap), (-gap / math.tan(math.radians(theta)), 0.0)
    half = 1.6
    ends = [(top[0] - half, gap), (top[0] + half, gap), (bottom[0] - half, 0.0), (bottom[0] + half, 0.0)]
    over, under = _polar(theta, 0.6, top), _polar(theta + 180, 0.6, bottom)
    known_spot, unknown_spot = (_label_spot(known, theta, top),
                                _label_spot(unknown, theta, bottom, clearance=0.22 if coefficient == 1 else 0.4))
    canvas = Canvas(size, ends + [over, under, known_spot, unknown_spot], margin=0.1)
    canvas.line(ends[0], ends[1])
    canvas.line(ends[2], ends[3])
    canvas.line(under, over)
    canvas.text(f"{_position_angle(known, theta)}°", known_spot)
    if coefficient == 1 and constant == 0:
        label = "x°"
    else:
        term = "x" if coefficient == 1 else f"{coefficient}x"
        label = f"({term} {'+' if constant >= 0 else '-'} {abs(constant)})°"
    canvas.text(label, unknown_spot)
    x = Fraction(_position_angle(unknown, theta) - constant, coefficient)
    return canvas.png(), "Find x.", fraction_text(x)


def right_triangle_trig(angle: int, hypotenuse: int, *, unknown: str = "opposite",
                        size: tuple[int, int] = (224, 224)) -> Problem:
    """Right triangle with one acute angle and the hypotenuse labelled; x to a tenth."""
    corner = (0.0, 0.0)
    far = (hypotenuse * math.cos(math.radians(angle)), 0.0)
    top = (0.0, hypotenuse * math.sin(math.radians(angle)))
    # The labelled angle is at `far`, between the base and the hypotenuse.
    canvas = Canvas(size, [corner, far, top])
    canvas.polygon([corner, far, top])
    canvas.right_angle(corner, far, top)
    inside = _centroid([corner, far, top])
    _angle_label(canvas, f"{angle}°", far, (corner, top))
    _side_label(canvas, str(hypotenuse), far, top, inside)
    if unknown == "opposite":
        _side_label(canvas, "x", corner, top, inside)
        value = hypotenuse * math.sin(math.radians(angle))
    elif unknown == "adjacent":
        _side_label(canvas, "x", corner, far, inside)
        value = hypotenuse * math.cos(math.radians(angle))
    else:
        raise ValueError(f"unknown must be 'opposite' or 'adjacent', got {unknown!r}")
    return canvas.png(), "Find x. Round to the nearest tenth.", tenth_text(value)


def midsegment(base: int, apex_x: float = 0.4, height: float = 0.8, *,
               size: tuple[int, int] = (224, 224)) -> Problem:
    """Triangle with the segment joining two sides' midpoints (tick-marked); x = base / 2."""
    a_pt, b_pt, c_pt = (0.0, 0.0), (1.0, 0.0), (apex_x, height)
    m_left, m_right = _mid(a_pt, c_pt), _mid(b_pt, c_pt)
    canvas = Canvas(size, [a_pt, b_pt, c_pt])
    canvas.polygon([a_pt, b_pt, c_pt])
    canvas.line(m_left, m_right)
    canvas.tick(a_pt, m_left, 1)
    canvas.tick(m_left, c_pt, 1)
    canvas.tick(b_pt, m_right, 2)
    canvas.tick(m_right, c_pt, 2)
    inside = _centroid([a_pt, b_pt, c_pt])
    _side_label(canvas, str(base), a_pt, b_pt, inside)
    canvas.text("x", _mid(m_left, m_right), toward=c_pt, distance=8)
    return canvas.png(), "Find x.", fraction_text(Fraction(base, 2))


def triangle_area(base: int, height: int, apex_fraction: float = 0.35, *,
                  size: tuple[int, int] = (224, 224)) -> Problem:
    """Triangle with base and (dashed) altitude labelled; area = base * height / 2."""
    a_pt, b_pt = (0.0, 0.0), (float(base), 0.0)
    apex = (apex_fraction * base, float(height))
    foot = (apex[0], 0.0)
    canvas = Canvas(size, [a_pt, b_pt, apex])
    canvas.polygon([a_pt, b_pt, apex])
    canvas.dashed(apex, foot)
    canvas.right_angle(foot, b_pt, apex, size_px=5)
    inside = _centroid([a_pt, b_pt, apex])
    _side_label(canvas, str(base), a_pt, b_pt, inside)
    canvas.text(str(height), _mid(apex, foot), toward=b_pt, distance=9)
    area = Fraction(base * height, 2)
    answer = str(area.numerator) if area.denominator == 1 else tenth_text(float(area))
    return canvas.png(), "Find the area of the triangle.", answer


# ------------------------------------------------------------------ random sampling

def _random_pythagoras(rng: random.Random, size) -> Problem:
    if rng.random() < 0.5:
        return pythagoras(rng.randint(2, 15), rng.randint(2, 15), size=size)
    hypotenuse = rng.randint(4, 20)
    # Keep the unknown leg at least a fifth of the hypotenuse so the figure stays legible.
    leg = rng.randint(2, max(2, math.floor(math.sqrt(0.96) * hypotenuse)))
    return pythagoras_leg(hypotenuse, min(leg, hypotenuse - 1), size=size)


def _random_triangle_angles(rng: random.Random, size) -> Problem:
    a = rng.randint(25, 100)
    b = rng.randint(25, min(130, 155 - a))
    return triangle_angles(a, b, size=size)


def _random_circle(rng: random.Random, size) -> Problem:
    return circle(rng.randint(2, 20), ask=rng.choice(["area", "circumference"]),
                  labelled=rng.choice(["radius", "diameter"]), size=size)


def _random_rectangle(rng: random.Random, size) -> Problem:
    width = rng.randint(3, 20)
    # Bounded aspect ratio: a sliver of a rectangle leaves no room for its labels.
    height = rng.randint(max(2, math.ceil(0.3 * width)), min(20, 2 * width))
    return rectangle(width, height, ask=rng.choice(["area", "perimeter", "diagonal"]), size=size)


def _random_parallel_lines(rng: random.Random, size) -> Problem:
    theta = rng.choice([t for t in range(35, 146, 5) if t != 90])
    known, unknown = rng.choice(ANGLE_POSITIONS), rng.choice(ANGLE_POSITIONS)
    if rng.random() < 0.5:
        return parallel_lines(theta, known, unknown, size=size)
    return parallel_lines(theta, known, unknown, coefficient=rng.randint(2, 5),
                          constant=rng.randint(-10, 20), size=size)


def _random_trig(rng: random.Random, size) -> Problem:
    return right_triangle_trig(rng.randint(25, 65), rng.randint(5, 25),
                               unknown=rng.choice(["opposite", "adjacent"]), size=size)


def _random_midsegment(rng: random.Random, size) -> Problem:
    return midsegment(rng.randint(5, 30), rng.uniform(0.2, 0.8), rng.uniform(0.6, 1.0), size=size)


def _random_triangle_area(rng: random.Random, size) -> Problem:
    return triangle_area(rng.randint(4, 20), rng.randint(3, 15), rng.uniform(0.2, 0.8), size=size)


KINDS: dict[str, Callable[[random.Random, tuple[int, int]], Problem]] = {
    "pythagoras": _random_pythagoras,
    "triangle_angles": _random_triangle_angles,
    "circle": _random_circle,
    "rectangle": _random_rectangle,
    "parallel_lines": _random_parallel_lines,
    "right_triangle_trig": _random_trig,
    "midsegment": _random_midsegment,
    "triangle_area": _random_triangle_area,
}


def generate(n: int, seed: int, *, size: tuple[int, int] = (224, 224),
             kinds: Sequence[str] | None = None) -> list[dict]:
    """`n` rows {"images": [{"bytes", "path"}], "problem": "<image>Find x.", "answer"}.

    `kinds` restricts the figure kinds (default: all of KINDS, chosen uniformly).
    """
    names = list(KINDS) if kinds is None else list(kinds)
    unknown = [k for k in names if k not in KINDS]
    if unknown or not names:
        raise ValueError(f"bad kinds {names!r}; known kinds: {', '.join(KINDS)}")
    if min(size) < 64:
        raise ValueError(f"size must be at least 64x64 for readable labels, got {size[0]}x{size[1]}")
    rows = []
    for i in range(n):
        rng = random.Random(f"geo3k:{seed}:{i}")
        png, question, answer = KINDS[rng.choice(names)](rng, size)
        rows.append({
            "images": [{"bytes": png, "path": f"geo3k_{i}.png"}],
            "problem": f"<image>{question}",
            "answer": answer,
        })
    return rows
