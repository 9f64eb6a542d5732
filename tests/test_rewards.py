"""Rewards and the math grader: mathruler's rules, bounded evaluator, formats, boxes, bounds, CLI."""

import ast
import json
import math
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from data import mathparse
from data.mathparse import (
    MathLimitError,
    MathParseError,
    MathTimeout,
    evaluate,
    expressions_equal,
    grade_answer,
)
from data.rewards import (
    DEFAULT_WEIGHTS,
    TASKS,
    RewardResult,
    extract_final_answer,
    giou,
    iou,
    parse_box,
    score,
    score_batch,
)

REPO = Path(__file__).resolve().parents[1]


def geo(answer_text: str) -> str:
    """A well-formatted geo3k response whose final answer is `answer_text`."""
    return f"<think>Angles in a triangle sum to 180.</think> \\boxed{{{answer_text}}}"


# ---------------------------------------------------------------------------------------------
# the evaluator (reads mathruler's normalized text: no LaTeX, no spaces)


@pytest.mark.parametrize(
    "text, value",
    [
        ("1+2*3", 7.0),
        ("(1+2)*3", 9.0),
        ("2^3^2", 512.0),  # right-associative
        ("2**3", 8.0),
        ("-2^2", -4.0),  # unary minus binds looser than ^
        ("2^-1", 0.5),
        ("7/2", 3.5),
        ("sqrt(3)/2", math.sqrt(3) / 2),
        ("2sqrt(3)", 2 * math.sqrt(3)),
        ("sqrt3", math.sqrt(3)),
        ("4pi", 4 * math.pi),
        ("3sqrt(2)pi", 3 * math.sqrt(2) * math.pi),
        ("pi/2", math.pi / 2),
        ("2(3+1)", 8.0),
        ("(1+1)(2)", 4.0),
        ("(2)3", 6.0),
        ("1/2*4", 2.0),
        ("-3.25", -3.25),
        (".5", 0.5),
        ("2.5e3", 2500.0),
    ],
)
def test_evaluate_values(text, value):
    assert evaluate(text) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize(
    "text", ["", "abc", "2 3", "(1+2", "1/0", "sqrt(-4)", "(-8)^0.5", "3,4", "[1]", "5!", "x", "√3"]
)
def test_evaluate_rejects(text):
    with pytest.raises(MathParseError):
        evaluate(text)


@pytest.mark.parametrize(
    "text", ["9^9^9^9^9", "10^65", "(10^60)^2", "(" * 60 + "1" + ")" * 60, "-" * 100 + "1", "1" * 400]
)
def test_evaluate_limits(text):
    start = time.perf_counter()
    with pytest.raises(MathLimitError):
        evaluate(text)
    assert time.perf_counter() - start < 0.1


def test_evaluator_checks_the_deadline():
    with pytest.raises(MathTimeout):
        evaluate("1+1", deadline=time.monotonic() - 1.0)


def test_expressions_with_variables_are_compared_as_identities():
    assert expressions_equal("2x", "x+x")
    assert expressions_equal("(x+1)^2", "x^2+2x+1")
    assert expressions_equal("xy/2", "y*x*0.5")
    assert not expressions_equal("2x", "3x")
    assert not expressions_equal("x", "y")
    assert expressions_equal("sqrt(12)", "2sqrt(3)")
    assert not expressions_equal("3.4641", "2sqrt(3)")  # a rounded value is not the exact one


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("1/2", "0.5", True),
        ("2/4", "1/2", False),  # unreduced fractions are not accepted (mathruler)
        ("60.0", "60", True),
        ("59.99", "60", False),  # an integer gold answer needs an integer
        (r"\frac{120}{2}", "60", False),  # ... written as one
        ("(1, 2)", "(1,2)", True),
        ("[1, 2]", "(1,2)", False),  # brackets must match
        ("(1, 2, 3)", "(1,2)", False),
        (r"\text{The Answer}", "the answer", True),
        ("xyz", "zyx", False),  # three letters: never evaluated
    ],
)
def test_grade_answer_follows_mathruler(pred, gold, equal):
    assert grade_answer(pred, gold) is equal


def test_grader_never_reaches_sympy(monkeypatch):
    """mathruler's own last step parses with sympy (eval of the text); ours must not run it."""
    import sympy
    from mathruler import grader
    from sympy.parsing import sympy_parser

    def refuse(*args, **kwargs):
        raise AssertionError("sympy was asked to parse or simplify an answer")

    for module, name in [(grader, "are_equal_under_sympy"), (grader, "_sympy_parse"),
                         (sympy_parser, "parse_expr"), (sympy, "sympify"), (sympy, "simplify"),
                         (grader.sympy, "simplify")]:
        monkeypatch.setattr(module, name, refuse)
    for pred, gold in [("2x+1", "1+x+x"), (r"2\sqrt{3}", r"\sqrt{12}"), ("3.5", r"\frac{7}{2}"),
                       ("__import__('os')", "1.5"), ("(1, 2)", "(1,2)"), (r"4\pi", "12.566")]:
        score("geo3k", geo(pred), gold)
        score("generic", f"<answer>{pred}</answer>", gold)


# ---------------------------------------------------------------------------------------------
# geo3k


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"\frac{7}{2}", "3.5"),
        ("3.5", r"\frac{7}{2}"),
        ("7/2", r"\frac{7}{2}"),
        (r"\dfrac{7}{2}", "7/2"),
        (r"2\sqrt{3}", r"\sqrt{12}"),
        (r"60^\circ", "60"),
        ("x = 5", "5"),
        (r"5\text{ cm}", "5"),
        ("1,200", "1200"),
    ],
)
def test_geo3k_equivalent_answers_score_full(pred, gold):
    result = score("geo3k", geo(pred), gold)
    assert result == RewardResult(1.0, 1.0, 1.0, "")


@pytest.mark.parametrize(
    "pred, gold",
    [("4", "3.5"), (r"\sqrt{13}", r"2\sqrt{3}"), ("25.16", "25.1"), ("25.1", "25.13"),
     ("25.4", "25"), ("61", "60"),
     # EasyR1 (mathruler) wants the exact value: a rounded decimal for an exact answer, or an
     # exact answer for a rounded gold decimal, is wrong.
     ("3.4641", r"2\sqrt{3}"), (r"4\pi", "12.566"), ("12.566", r"4\pi"), ("25.13", "25.1"),
     (r"8\sqrt{10}", "25.3"), ("abc", "5"),
     ("60°", "60")],  # mathruler drops ^\circ but not the degree sign
)
def test_geo3k_wrong_answers_score_low(pred, gold):
    result = score("geo3k", geo(pred), gold)
    assert result.accuracy == 0.0
    assert result.score == pytest.approx(0.1)  # format only
    assert result.reason == "wrong_answer"


def test_geo3k_missing_answers():
    missing = score("geo3k", "<think>so it is 5</think> five", "5")
    assert (missing.score, missing.reason) == (0.0, "no_answer_found")
    tags = score("geo3k", "<think>r</think> <answer>5</answer>", "5")  # EasyR1 reads \boxed only
    assert (tags.score, tags.format, tags.reason) == (0.0, 0.0, "no_answer_found")
    empty = score("geo3k", "<think>r</think> \\boxed{}", "5")
    assert (empty.format, empty.reason) == (1.0, "no_answer_found")


@pytest.mark.parametrize(
    "response",
    [
        "<think>r</think>\\boxed{5}",
        "  <think>\nr\n</think>\n\n\\boxed{5}\n",
        "<think>r</think><answer>\\boxed{5}</answer>",
        "< think >r< /think > \\boxed{5}",  # spaces inside tags are removed first
        "<think>r</think> The answer is \\boxed{5}",  # text before the answer
        "<think>r</think> \\boxed{5}.",  # text after the answer
        "<think>a</think><think>b</think>\\boxed{5}",
    ],
)
def test_geo3k_format_accepted(response):
    assert score("geo3k", response, "5") == RewardResult(1.0, 1.0, 1.0, "")


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{5}",  # no think block
        "intro <think>r</think>\\boxed{5}",  # text before think
        "<think>r \\boxed{5}",  # think never closed
        "<think>\\boxed{5}</think>",  # the box is inside the think block
    ],
)
def test_geo3k_format_rejected(response):
    result = score("geo3k", response, "5")
    assert result.format == 0.0
    assert result.accuracy == 1.0
    assert result.score == pytest.approx(0.9)
    assert result.reason == "bad_format"


def test_geo3k_uses_the_last_box_anywhere():
    assert extract_final_answer("<think>maybe \\boxed{3}</think> \\boxed{4}", "geo3k") == "4"
    assert extract_final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}", "geo3k") == "\\frac{1}{2}"
    assert extract_final_answer("<think>\\boxed{3}</think> nothing", "geo3k") == "3"
    assert extract_final_answer("<think>t</think><answer> 7 </answer>", "geo3k") is None
    assert extract_final_answer("\\boxed{1} and \\boxed{2", "geo3k") is None  # last one unclosed
    assert extract_final_answer("\\boxed{ 7 / 2 }", "geo3k") == "7/2"


def test_weights_are_configurable_and_checked():
    result = score("geo3k", "\\boxed{5}", "5", weights={"accuracy": 0.5})
    assert result.score == pytest.approx(0.5)
    result = score("geo3k", geo("4"), "5", weights={"accuracy": 0.3, "format": 0.7})
    assert result.score == pytest.approx(0.7)
    with pytest.raises(ValueError, match="acc"):
        score("geo3k", geo("5"), "5", weights={"acc": 1.0})
    assert DEFAULT_WEIGHTS["geo3k"] == {"accuracy": 0.9, "format": 0.1}


# ---------------------------------------------------------------------------------------------
# clevr and generic


@pytest.mark.parametrize(
    "content, accuracy",
    [("3", 1.0), (" 3 ", 1.0), ("3.0", 1.0), ("03", 1.0), ("4", 0.0), ("three", 0.0),
     ("3.5", 0.0), ("", 0.0)],
)
def test_clevr_exact_integer(content, accuracy):
    result = score("clevr", f"<answer>{content}</answer>", "3")
    assert result.accuracy == accuracy
    assert result.format == 1.0
    assert result.score == pytest.approx(0.8 * accuracy + 0.2)


def test_clevr_format_and_last_answer():
    assert score("clevr", "<think>count</think><answer>2</answer>", "2").score == pytest.approx(1.0)
    assert score("clevr", "<answer>1</answer> wait <answer>2</answer>", "2").accuracy == 1.0
    no_tag = score("clevr", "the answer is 2", "2")
    assert (no_tag.score, no_tag.format, no_tag.reason) == (0.0, 0.0, "no_answer_found")
    assert score("clevr", "<answer>2</answer>", "two").reason == "invalid_gold_answer"


def test_generic_string_then_numeric():
    assert score("generic", "<answer> The  Red Cube. </answer>", "the red cube").accuracy == 1.0
    assert score("generic", "<answer>\\boxed{1/2}</answer>", "0.5").accuracy == 1.0
    assert score("generic", "<answer>$\\frac{7}{2}$</answer>", "3.5").accuracy == 1.0
    wrong = score("generic", "<answer>blue</answer>", "red")
    assert (wrong.accuracy, wrong.format, wrong.reason) == (0.0, 1.0, "wrong_answer")


# ---------------------------------------------------------------------------------------------
# grounding


def test_iou_and_giou_by_hand():
    # Overlap 5x5 = 25, union 100 + 100 - 25 = 175, enclosing 15x15 = 225.
    assert iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
    assert giou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175 - (225 - 175) / 225)
    # Disjoint: union 2, enclosing 3x3 = 9.
    assert iou([0, 0, 1, 1], [2, 2, 3, 3]) == 0.0
    assert giou([0, 0, 1, 1], [2, 2, 3, 3]) == pytest.approx(-7 / 9)
    assert iou([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert giou([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    # Containment: 4 / 16.
    assert iou([0, 0, 4, 4], [1, 1, 3, 3]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="x1 <= x2"):
        iou([5, 0, 1, 1], [0, 0, 1, 1])


def test_grounding_scores():
    result = score("grounding", "<answer>[5, 5, 15, 15]</answer>", "[0, 0, 10, 10]")
    assert result.accuracy == pytest.approx(25 / 175)
    assert result.score == pytest.approx(0.8 * 25 / 175 + 0.2)
    json_like = '<answer>[{"bbox_2d": [0, 0, 4, 4], "label": "cat"}]</answer>'
    assert score("grounding", json_like, "[1, 1, 3, 3]").accuracy == pytest.approx(0.25)
    hit = score("grounding", "<answer>[0,0,10,10]</answer>", "[0, 0, 10, 11]", iou_threshold=0.5)
    miss = score("grounding", "<answer>[5,5,15,15]</answer>", "[0, 0, 10, 10]", iou_threshold=0.5)
    assert (hit.accuracy, miss.accuracy) == (1.0, 0.0)
    assert score("grounding", "<answer>[9, 9, 1, 1]</answer>", "[0,0,1,1]").reason == "invalid_box"
    assert score("grounding", "<answer>left</answer>", "[0,0,1,1]").reason == "unparseable_answer"
    assert score("grounding", "<answer>[1,1,2,2]</answer>", "nope").reason == "invalid_gold_answer"
    assert parse_box("box (1.5, 2, 3e1, 40)") == (1.5, 2.0, 30.0, 40.0)
    with pytest.raises(ValueError, match="grounding"):
        score("clevr", "<answer>1</answer>", "1", iou_threshold=0.5)


# ---------------------------------------------------------------------------------------------
# bounds


@pytest.mark.parametrize(
    "response",
    [
        geo("9^9^9^9^9"),
        geo("{" * 10_000 + "1" + "}" * 10_000),
        "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        "<think></think><answer>" + "(" * 5_000 + "</answer>",
        geo("(" * 60 + "1" + ")" * 60),
        geo("1" * 1_000_000),
        "x" * 1_000_000,
        "\\boxed{" * 200_000,
        "<answer>" * 200_000 + "</answer>",
        "<think>" + "a" * 1_000_000 + "</think>" + "\\boxed{1+" * 50_000,
        " " * 1_000_000 + "x",  # the space removal around tags must stay linear
        "a " * 500_000 + "/",
        "<think>" + "</think>" * 100_000 + "\\boxed{" * 100_000,
    ],
)
@pytest.mark.parametrize("task", ["geo3k", "clevr", "generic"])
def test_pathological_inputs_finish_fast(response, task):
    start = time.perf_counter()
    result = score(task, response, "1")
    assert time.perf_counter() - start < 1.0
    assert result.accuracy == 0.0
    assert result.score <= DEFAULT_WEIGHTS[task]["format"] + 1e-12
    assert result.reason


def test_random_text_never_raises_and_stays_in_range():
    pieces = list("0123456789+-*/^(){}[]., %=xπ√°²") + [
        "\\frac", "\\sqrt", "\\pi", "\\cdot", "\\boxed{", "<answer>", "</answer>", "<think>",
        "</think>", "\\text{cm}", "^\\circ", "e5", "\\left(", "\\right)", "1,000", "\\",
    ]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        gold = "".join(rng.choice(pieces[:16]) for _ in range(rng.randint(1, 6)))
        for task in TASKS:
            for response in (text, f"<think>t</think><answer>{text}</answer>", geo(text)):
                result = score(task, response, gold)
                weights = DEFAULT_WEIGHTS[task]
                assert 0.0 <= result.accuracy <= 1.0 and result.format in (0.0, 1.0)
                expected = weights["accuracy"] * result.accuracy + weights["format"] * result.format
                assert result.score == pytest.approx(expected)
                assert result.reason or result.score == pytest.approx(1.0) or task == "grounding"


def test_size_limit_zeroes_everything_value_limit_is_wrong():
    assert score("geo3k", geo("1" * 5000), "5") == RewardResult(0.0, 0.0, 0.0, "answer_too_long")
    huge = score("geo3k", geo("((9^9)^9)^9"), "2.5")  # beyond MAX_MAGNITUDE: not equal
    assert (huge.accuracy, huge.format, huge.reason) == (0.0, 1.0, "wrong_answer")


def test_timeout_works_off_the_main_thread():
    results = []
    def work():
        results.append(score("geo3k", geo("1"), "1", timeout_s=1e-9))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(5.0)
    assert results == [RewardResult(0.0, 0.0, 0.0, "timeout")]
    assert score("geo3k", geo("1"), "1", timeout_s=5.0).score == 1.0


def test_no_code_execution_in_sources():
    for name in ("rewards.py", "mathparse.py"):
        source = (REPO / "data" / name).read_text()
        for banned in ("eval(", "exec(", "sympify", "parse_expr", "compile(", "__import__"):
            assert banned not in source.replace("re.compile(", ""), f"{banned} in data/{name}"
        called = {
            node.func.id
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert not called & {"eval", "exec", "compile", "__import__"}


# ---------------------------------------------------------------------------------------------
# API surface and CLI


def test_unknown_task_lists_tasks():
    with pytest.raises(ValueError) as info:
        score("math500", "x", "1")
    assert all(task in str(info.value) for task in TASKS)
    with pytest.raises(ValueError, match="geo3k"):
        extract_final_answer("x", "nope")


def test_score_batch():
    results = score_batch("clevr", ["<answer>1</answer>", "<answer>2</answer>"], ["1", "1"])
    assert [r.accuracy for r in results] == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score_batch("clevr", ["a", "b"], ["1"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        score("clevr", "<answer>1</answer>", "1", timeout_s=0)
    with pytest.raises(TypeError, match="response"):
        score("clevr", None, "1")


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "data.rewards", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_cli_prints_one_json_object():
    response = "<think>t</think> \\boxed{\\frac{7}{2}}"
    done = run_cli("--task", "geo3k", "--response", response, "--answer", "3.5")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload == {"score": 1.0, "accuracy": 1.0, "format": 1.0, "reason": ""}
    assert done.stdout.strip().count("\n") == 0


def test_cli_options():
    done = run_cli(
        "--task", "grounding", "--response", "<answer>[0, 0, 10, 10]</answer>",
        "--answer", "[0, 0, 10, 11]", "--iou-threshold", "0.9", "--weights", '{"format": 0}',
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"score": 0.8, "accuracy": 1.0, "format": 1.0, "reason": ""}
    bad = run_cli("--task", "clevr", "--response", "x", "--answer", "1", "--weights", "[1]")
    assert bad.returncode == 2 and "JSON object" in bad.stderr


def test_cli_bad_task_exits_2():
    done = run_cli("--task", "nope", "--response", "x", "--answer", "1")
    assert done.returncode == 2
    assert "geo3k" in done.stderr and "nope" in done.stderr
    assert done.stdout == ""


def test_module_constants_are_consistent():
    assert set(DEFAULT_WEIGHTS) == set(TASKS)
    assert mathparse.MAX_EXPR_CHARS <= mathparse.MAX_ANSWER_CHARS


def test_clevr_format_needs_the_answer_last():
    from data.rewards import score as _score

    assert _score("clevr", "<answer>3</answer>", "3").format == 1.0
    assert _score("clevr", "<think>three</think> <answer>3</answer>\n", "3").format == 1.0
    rambling = _score("clevr", "<answer>3</answer> and then more words", "3")
    assert rambling.format == 0.0 and rambling.accuracy == 1.0
    assert _score("clevr", "<answer>2</answer><answer>3</answer>", "3").format == 0.0
    assert _score("clevr", "<answer>3</answer><ans", "3").format == 0.0  # cut off


def test_agreement_corpus_is_fixed_and_large_enough():
    """tools/reward_agreement.py compares with EasyR1 on these pairs (README has the numbers)."""
    from tools.reward_agreement import generated_pairs, pairs_from_tests

    ours = pairs_from_tests()
    assert len(ours) >= 100 and all(origin.startswith("tests:") for origin, _, _ in ours)
    assert generated_pairs(300, 0) == generated_pairs(300, 0) != generated_pairs(300, 1)
    assert len(ours) + len(generated_pairs(300, 0)) >= 200
