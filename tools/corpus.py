"""A generated text corpus for training the tiny checkpoints' tokenizer.

The corpus covers what vlrl's prompts and responses contain: CLEVR-style counting
questions, Geometry3K-style problems, numbers and decimals, LaTeX (fractions, roots,
degrees, pi, boxed answers), `<think>`/`<answer>` formatted responses, instruction
phrasings and the text around the chat template's special tokens. It is generated
from a fixed seed, so the same code always yields the same lines (and so the same
tokenizer), whatever seed the model weights are drawn with.

The family's special tokens (`<|im_start|>`, `<|image_pad|>`, ...) never appear here:
they are added to the tokenizer after training, as single ids, so the BPE merges are
spent on ordinary text only.
"""

from __future__ import annotations

import random

# Fixed on purpose: the tokenizer must not change with the model seed.
CORPUS_SEED = 1234

COLORS = ("gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow")
SHAPES = ("cube", "sphere", "cylinder")
SIZES = ("small", "large", "big", "tiny")
MATERIALS = ("rubber", "metal", "matte", "shiny", "metallic")
RELATIONS = ("left of", "right of", "behind", "in front of")
POINTS = "ABCDEFGHJKLMNPQRSTWXYZ"
VARIABLES = ("x", "y", "z", "a", "b", "c")
FIGURES = (
    "triangle", "circle", "square", "rectangle", "parallelogram", "trapezoid",
    "rhombus", "kite", "regular hexagon", "regular pentagon", "polygon", "figure",
)
GREEK_AND_SYMBOLS = ("°", "π", "√", "≈", "×", "÷", "≤", "≥", "≠", "∠", "△", "⊙", "∥", "⊥", "±", "·")

CHAT_PIECES = (
    "system\nYou are a helpful assistant.\n",
    "You are a helpful assistant.\n",
    "user\n",
    "assistant\n",
    "Picture 1: ",
    "Picture 2: ",
    "Video 1: ",
)

INSTRUCTIONS = (
    "Think step by step inside <think> </think> tags, then give the final answer inside <answer> </answer> tags.",
    "First reason about the problem inside <think> </think>, then put the final answer in \\boxed{}.",
    "Show your reasoning in <think> </think> and write only the number in <answer> </answer>.",
    "Answer the question using a single number.",
    "Answer with a single word or number.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The reasoning process MUST BE enclosed within <think> </think> tags.",
    "The final answer MUST BE put in \\boxed{}.",
)

PROSE = (
    "The image shows a scene with several objects on a flat surface.",
    "Count each object carefully before answering.",
    "Look at the diagram and use the given lengths and angles.",
    "The answer is the number of objects that match the description.",
    "Use the Pythagorean theorem to find the missing side.",
    "The sum of the interior angles of a triangle is 180 degrees.",
    "Opposite angles of a parallelogram are equal.",
    "The circumference of a circle is 2 \\pi r and its area is \\pi r^2.",
    "Corresponding sides of similar triangles are proportional.",
    "Vertical angles are congruent, and a linear pair sums to 180 degrees.",
    "The question asks for a count, so the answer is a whole number.",
    "Round the result to the nearest tenth if necessary.",
    "Therefore, the final answer is shown below.",
    "Let me check the calculation again to be sure.",
    "So the value of x that satisfies the equation is found.",
)


# Everyday and mathematical words for free-form reasoning text.
WORDS = tuple("""
the a an of and to in is are was were be been it its this that these those there here
we you they he she i my our your their which what who whom whose when where why how
for on with as at by from into onto over under about after before between through during
or but not no yes if then else so because since therefore thus hence also only just even
all each every both either neither some any many much more most less least few fewer
one two three four five six seven eight nine ten eleven twelve twenty hundred thousand
first second third fourth last next previous other another same different similar
find compute calculate solve determine show prove explain describe count list name give
equal equals sum difference product quotient total number numbers value values answer
question image picture photo scene view object objects item items thing things shape shapes
color colors size sizes material left right front behind above below near far top bottom
middle center corner edge side sides angle angles triangle triangles circle circles
radius radii diameter chord arc tangent secant segment line lines ray parallel
perpendicular bisector median altitude height base length width area perimeter volume
surface degree degrees measure ratio proportion congruent acute obtuse isosceles
equilateral scalene hypotenuse leg legs vertex vertices point points interior exterior
opposite adjacent supplementary complementary vertical horizontal inscribed circumscribed
central circumference quadrilateral polygon pentagon hexagon octagon diagonal diagonals
square root fraction decimal integer whole nearest tenth hundredth round rounded
approximately exactly about formula theorem rule property law sines cosines sine cosine
equation expression variable unknown substitute simplify multiply divide add subtract
plus minus times over half twice double triple step steps check verify correct wrong
final result think reasoning carefully look see notice observe appears shown figure
diagram given information known unknown must should would could can will may might
cube cubes sphere spheres cylinder cylinders ball balls block blocks box boxes
red blue green yellow gray grey brown purple cyan black white orange pink
small large big tiny huge rubber metal metallic matte shiny glossy
has have had do does did make makes made get gets got take takes took use uses used
because while until unless although though whether nothing something everything
figure out then we get so the answer is let me recall that since we know
""".split())

LATEX_COMMANDS = (
    "\\angle", "\\triangle", "\\overline", "\\odot", "\\parallel", "\\perp", "\\cdot",
    "\\times", "\\div", "\\leq", "\\geq", "\\neq", "\\approx", "\\sin", "\\cos", "\\tan",
    "\\log", "\\sqrt", "\\frac", "\\dfrac", "\\pi", "\\circ", "\\boxed", "\\text", "\\left",
    "\\right", "\\quad", "\\therefore", "\\because", "\\cong", "\\sim", "\\widehat",
    "\\mathrm", "\\degree", "\\alpha", "\\beta", "\\theta", "\\infty", "\\pm",
)


def _sentence(rng: random.Random) -> str:
    """A loose sentence of corpus words, capitalized and punctuated."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(LATEX_COMMANDS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "?", ",", ":"))


def _counting_question(rng: random.Random) -> str:
    """One CLEVR-style counting question."""
    color, color2 = rng.choice(COLORS), rng.choice(COLORS)
    shape, shape2 = rng.choice(SHAPES), rng.choice(SHAPES)
    size, material = rng.choice(SIZES), rng.choice(MATERIALS)
    templates = (
        f"How many {color} {shape}s are there?",
        f"How many {size} {material} objects are there?",
        "How many objects are there?",
        f"How many {color} objects are {rng.choice(RELATIONS)} the {size} {shape}?",
        f"Subtract all {color} {shape}s. How many objects are left?",
        f"Subtract all {size} {material} {shape2}s. How many {shape}s are left?",
        f"What number of {size} {color} {shape}s are there?",
        f"Are there more {shape}s than {color2} {shape2}s?",
        f"Count the {color} {material} {shape}s in the image.",
        f"What number of other objects are the same shape as the {size} {color} {material} object?",
    )
    return rng.choice(templates)


def _counting_response(rng: random.Random) -> str:
    """A formatted reasoning trace and answer for a counting question."""
    n, m = rng.randint(0, 10), rng.randint(0, 10)
    color, color2 = rng.choice(COLORS), rng.choice(COLORS)
    shape, shape2 = rng.choice(SHAPES), rng.choice(SHAPES)
    thought = (
        f"I see {n} {color} {shape}s and {m} {color2} {shape2}s. "
        f"In total there are {n} + {m} = {n + m} objects."
    )
    style = rng.randrange(3)
    if style == 0:
        return f"<think> {thought} </think> <answer>{n + m}</answer>"
    if style == 1:
        return f"<think>\n{thought}\n</think>\n<answer>\n{n + m}\n</answer>"
    return f"<think>{thought}</think><answer>{n + m}</answer>"


def _latex_value(rng: random.Random) -> str:
    """A short LaTeX answer of the kinds found in geometry datasets."""
    a, b = rng.randint(1, 30), rng.randint(2, 12)
    kinds = (
        f"\\frac{{{a}}}{{{b}}}",
        f"{a}\\sqrt{{{b}}}",
        f"\\sqrt{{{a}}}",
        f"{a * 5}°",
        f"{a * 5}^\\circ",
        f"{a}\\pi",
        f"\\frac{{{a}\\sqrt{{{b}}}}}{{{b + 1}}}",
        f"\\frac{{{a}}}{{{b}}}\\pi",
        f"{a}.{rng.randint(0, 9)}",
        f"{a * b}",
    )
    return rng.choice(kinds)


def _geometry_question(rng: random.Random) -> str:
    """One Geometry3K-style problem statement."""
    p, q, r = rng.sample(POINTS, 3)
    var, figure = rng.choice(VARIABLES), rng.choice(FIGURES)
    a, b = rng.randint(1, 60), rng.randint(1, 60)
    templates = (
        f"Find {var}.",
        f"Find {var}. Round to the nearest tenth.",
        f"Find the area of the {figure}. Round to the nearest tenth.",
        f"Find the perimeter of the {figure}. Round to the nearest tenth if necessary.",
        f"Find m \\angle {p}{q}{r}.",
        f"Find the measure of \\angle {rng.randint(1, 8)}.",
        f"Find the length of \\overline{{{p}{q}}}.",
        f"In \\odot {p}, {q}{r} = {a}. Find the radius.",
        f"If {p}{q} = {a} and {q}{r} = {b}, find {p}{r}.",
        f"\\triangle {p}{q}{r} \\sim \\triangle {q}{r}{p}. Find {var}.",
        f"m \\angle {rng.randint(1, 8)} = {a}{var} + {b}. Find m \\angle {rng.randint(1, 8)}.",
        f"Find \\sin {p}. Express as a fraction.",
        f"Solve for {var}: {a}{var} + {b} = {a * 3 + b}.",
        f"Find the area of the shaded region. Round to the nearest tenth.",
        f"The radius of the circle is {a}. Find the circumference.",
        f"Find {var} so that \\overline{{{p}{q}}} \\parallel \\overline{{{q}{r}}}.",
    )
    return rng.choice(templates)


def _geometry_response(rng: random.Random) -> str:
    """A formatted reasoning trace and answer for a geometry problem."""
    r = rng.randint(1, 20)
    area = round(3.14159265 * r * r, 1)
    value = _latex_value(rng)
    thought = rng.choice((
        f"The radius is {r}, so the area is \\pi r^2 = {r * r}\\pi \\approx {area}.",
        f"The angles sum to 180^\\circ, so {rng.randint(20, 80)} + {rng.randint(20, 80)} + x = 180.",
        f"By the Pythagorean theorem, c^2 = a^2 + b^2, so c = {value}.",
        f"The triangles are similar, so \\frac{{x}}{{{r}}} = \\frac{{{r + 2}}}{{{r + 1}}}.",
        f"Since the angles form a linear pair, 2x + {r} = 180 and x = {(180 - r) / 2}.",
    ))
    answer = rng.choice((value, str(area), str(r)))
    style = rng.randrange(3)
    if style == 0:
        return f"<think> {thought} </think> <answer>{answer}</answer>"
    if style == 1:
        return f"<think>\n{thought}\n</think>\n\n\\boxed{{{answer}}}"
    return f"{thought} The answer is \\boxed{{{answer}}}."


def _geometry_facts(rng: random.Random) -> str:
    """Given lengths and angles of a figure, naming its points as diagrams do."""
    p, q, r, t = rng.sample(POINTS, 4)
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(10, 170)
    facts = (
        f"In \\triangle {p}{q}{r}, {p}{q} = {a}, {q}{r} = {b}, and m \\angle {p}{q}{r} = {c}°.",
        f"{p}{q} = {a}, {r}{t} = {b}, \\overline{{{p}{q}}} \\parallel \\overline{{{r}{t}}}.",
        f"Quadrilateral {p}{q}{r}{t} is a {rng.choice(FIGURES)} with {p}{r} = {a} and {q}{t} = {b}.",
        f"\\angle {p}{q}{t} \\cong \\angle {t}{q}{r}, so {q}{t} bisects \\angle {p}{q}{r}.",
        f"Point {t} lies on \\odot {p}, and {p}{t} = {a} is a radius.",
        f"\\overline{{{p}{t}}} \\perp \\overline{{{q}{r}}} at {t}, {q}{t} = {a}, {t}{r} = {b}.",
    )
    return rng.choice(facts)


def _numbers() -> list[str]:
    """Integers 0-1000 and a spread of decimals, one per line."""
    lines = [str(i) for i in range(1001)]
    lines += [f"{i / 10:.1f}" for i in range(0, 1000, 7)]
    lines += [f"{i / 100:.2f}" for i in range(0, 1000, 13)]
    lines += [f"-{i}" for i in range(1, 50)]
    lines += [f"{i}%" for i in range(0, 101, 5)]
    return lines


def _unicode_lines(rng: random.Random) -> list[str]:
    """Lines mixing math symbols and non-ASCII text so these bytes get merges too."""
    lines = [" ".join(GREEK_AND_SYMBOLS)]
    for _ in range(200):
        a, b = rng.randint(1, 90), rng.randint(1, 9)
        sym = rng.choice(GREEK_AND_SYMBOLS)
        lines.append(f"∠{rng.choice(POINTS)} = {a}° {sym} {b}π ≈ {a * b}")
    lines += ["café naïve résumé", "Größe über", "三角形 圆 面积", "x² + y² = r²"]
    return lines


def generate_corpus(num_lines: int = 6000) -> list[str]:
    """Return the tokenizer-training corpus: a deterministic list of text lines.

    `num_lines` is the number of generated question/response lines; the fixed
    lines (numbers, chat pieces, instructions, prose, unicode) come on top.
    """
    if num_lines < 1:
        raise ValueError(f"generate_corpus: num_lines must be positive, got {num_lines}")
    rng = random.Random(CORPUS_SEED)
    makers = (_counting_question, _counting_response, _geometry_question, _geometry_response)
    lines: list[str] = []
    for i in range(num_lines):
        line = makers[i % len(makers)](rng)
        if i % 5 == 0:
            line = f"{line} {rng.choice(INSTRUCTIONS)}"
        if i % 7 == 0:
            line = f"{rng.choice(CHAT_PIECES)}{line}"
        lines.append(line)
    lines += _numbers()
    lines += list(CHAT_PIECES) * 20 + list(INSTRUCTIONS) * 20 + list(PROSE) * 20
    lines += _unicode_lines(rng)
    lines += [_sentence(rng) for _ in range(num_lines // 2)]
    lines += [_geometry_facts(rng) for _ in range(num_lines // 2)]
    lines += [" ".join(LATEX_COMMANDS)] * 10
    return lines
