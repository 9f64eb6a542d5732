"""Rewards: one number per response, from a format check and an accuracy check.

Tasks (`TASKS`), each scored as ``weights["accuracy"] * accuracy + weights["format"] * format``:

- ``geo3k`` (default 0.9 / 0.1): EasyR1's geo3k reward (``examples/reward_function/math.py``).
  Spaces around ``<``, ``>`` and ``/`` are removed first (as EasyR1 does for Qwen2.5-VL-32B's
  ``< think >``). Format is 1 when the response starts with ``<think>``, closes it, and has a
  ``\\boxed{...}`` somewhere after (text between and after is allowed). The final answer is the
  content of the last ``\\boxed{`` up to its matching brace (none when it never closes), and
  accuracy is `data.mathparse.grade_answer`: mathruler's ``grade_answer`` rules with a bounded
  evaluator in place of sympy (``\\frac{7}{2}`` = ``3.5`` = ``7/2``, ``2\\sqrt{3}`` =
  ``\\sqrt{12}``, ``60^\\circ`` = ``60``, ``x = 5`` = ``5``; but ``3.4641`` ≠ ``2\\sqrt{3}`` and
  ``2/4`` ≠ ``1/2``). tools/reward_agreement.py measures the agreement with EasyR1's scorer.
- ``clevr`` (0.8 / 0.2). Format is 1 when the response ends with its one ``<answer>...</answer>``
  pair (optionally after a ``<think>...</think>`` block; nothing but whitespace after the answer),
  so a response that rambles past its answer, or is cut off, earns no format credit. Accuracy is an exact integer match of the last answer's stripped content: "3" and
  "3.0" both count as 3; words ("three") and non-integers do not.
- ``generic`` (0.8 / 0.2). Format is 1 when an ``<answer>...</answer>`` pair exists. Accuracy: loose string equality (case, spaces,
  ``$``, ``\\text{}`` and a final period ignored; a content that is exactly ``\\boxed{...}`` is
  unwrapped), falling back to geo3k's `grade_answer`.
- ``grounding`` (0.8 / 0.2). Format as generic. The gold answer is a box "[x1, y1, x2, y2]"; the
  first box of four numbers in ``[...]`` or ``(...)`` inside the last answer is the prediction.
  Accuracy is their IoU, or — with ``iou_threshold`` — 1.0 when IoU >= threshold, else 0.0.
- ``zoom`` (0.8 / 0.2), the DeepEyes-style zoom-in task (data/generators/zoom.py). Format as clevr
  (the response ends with its one answer pair). Accuracy: the last answer's content equals the
  gold answer as free text (generic's loose comparison, without the math fallback).
- ``video`` (0.8 / 0.2), video questions (data/generators/video.py, Video-R1's rows). Format as
  clevr. Accuracy compares the last answer's content with the gold answer by the gold's form: an
  option letter ("B") matches "B", "(B)" or "B. text"; a number matches the same number ("3" =
  "3.0", "0.5" = ".5"); anything else matches as free text (zoom's loose comparison: "Left" =
  "left.").

Every result carries a ``reason``: "" on full success, otherwise one of "no_answer_found",
"unparseable_answer", "wrong_answer", "invalid_box", "invalid_gold_answer", "bad_format",
"answer_too_long" or "timeout".

Guarantee: no text is ever run as code; math goes through the bounded evaluator in
`data.mathparse`. Scanning a response uses only C-level string searches (``find``/``rfind``/
``count``) and regular expressions that never backtrack over a span twice, linear in its length
(a few milliseconds per megabyte); every Python-level loop runs
over at most `MAX_ANSWER_CHARS` characters. Each `score` call carries a deadline of ``timeout_s``
seconds, checked between phases and inside the parser's step loop (no signals, so any thread
works). An answer longer than `MAX_ANSWER_CHARS`, or the deadline, gives score, accuracy and
format all 0 with the reason set; an answer whose value is beyond the evaluator's bounds (an
exponent or magnitude too large, nesting too deep) is a wrong answer.

CLI: ``python -m data.rewards --task T --response R --answer A`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from data.mathparse import (
    MAX_ANSWER_CHARS,
    MathLimitError,
    MathTimeout,
    MathTooLong,
    check_deadline,
    grade_answer,
)

TASKS = ("geo3k", "clevr", "generic", "grounding", "zoom", "video")
DEFAULT_WEIGHTS = {
    "geo3k": {"accuracy": 0.9, "format": 0.1},
    "clevr": {"accuracy": 0.8, "format": 0.2},
    "generic": {"accuracy": 0.8, "format": 0.2},
    "grounding": {"accuracy": 0.8, "format": 0.2},
    "zoom": {"accuracy": 0.8, "format": 0.2},
    "video": {"accuracy": 0.8, "format": 0.2},
}
MAX_INTEGER_DIGITS = 100  # longer integers (sign included) are not read as a count

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_BOXED = "\\boxed{"
# EasyR1's re.sub(r"\s*(<|>|/)\s*", r"\1", ...) backtracks quadratically over long runs of spaces;
# these two passes remove the same spaces in linear time (a run starts only where no space is).
_SPACE_AFTER_TAG_CHAR = re.compile(r"(?<=[<>/])\s+")
_SPACE_BEFORE_TAG_CHAR = re.compile(r"(?<!\s)\s++(?=[<>/])")
_LOOSE_DROP = re.compile(r"\\[()\[\]]|\\?\$")
_LOOSE_TEXT = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_INTEGER = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_NUM = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_BOX = re.compile(rf"[\[(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\])]")
_NUMBER = re.compile(_NUM)
# video: a gold option letter ("B" or "(B)"), and a predicted choice: the letter alone, in
# parentheses, or followed by ".", ":" or ")" and the option's text
_OPTION_LETTER = re.compile(r"\(?[A-Z]\)?")
_OPTION_CHOICE = re.compile(r"\(?([A-Z])(?:\)|[.:]|$|\s)")


@dataclass
class RewardResult:
    """Reward of one response: `score` is the weighted sum of `accuracy` and `format`."""

    score: float
    accuracy: float
    format: float
    reason: str = ""


# ---------------------------------------------------------------------------------------------
# extraction


def _collapse_tag_spaces(response: str) -> str:
    """The response without spaces around ``<``, ``>`` and ``/`` (what EasyR1 scores)."""
    return _SPACE_BEFORE_TAG_CHAR.sub("", _SPACE_AFTER_TAG_CHAR.sub("", response))


def _boxed_span(text: str, start: int) -> tuple[str, int] | None:
    """Content of the ``\\boxed{...}`` at `start` and the index just past its matching brace;
    None if it never closes (a truncated response). Scans at most MAX_ANSWER_CHARS characters."""
    begin = start + len(_BOXED)
    stop = min(len(text), begin + MAX_ANSWER_CHARS + 1)
    depth = 1
    for index in range(begin, stop):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index], index + 1
    if stop < len(text):
        raise MathTooLong(f"\\boxed answer longer than {MAX_ANSWER_CHARS} characters")
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in `text` (only the last one is considered)."""
    start = text.rfind(_BOXED)
    span = None if start < 0 else _boxed_span(text, start)
    return None if span is None else span[0]


def _last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, or None."""
    close = text.rfind(_ANSWER_CLOSE)
    if close < 0:
        return None
    open_ = text.rfind(_ANSWER_OPEN, 0, close)
    if open_ < 0:
        return None
    content = text[open_ + len(_ANSWER_OPEN) : close]
    if len(content) > MAX_ANSWER_CHARS:
        raise MathTooLong(f"<answer> content longer than {MAX_ANSWER_CHARS} characters")
    return content


def extract_final_answer(response: str, task: str) -> str | None:
    """The final answer text of `response` for `task` (stripped), or None when there is none.

    geo3k: the last ``\\boxed{}`` (spaces around ``<``, ``>`` and ``/`` removed first, as in
    EasyR1); an unclosed last box is no answer. Other tasks: the last ``<answer>`` content; generic also unwraps a content that is exactly
    ``\\boxed{...}``. Raises `MathLimitError` when the answer exceeds `MAX_ANSWER_CHARS` and
    ValueError for an unknown task.
    """
    _check_task(task)
    if task == "geo3k":
        found = _last_boxed(_collapse_tag_spaces(response))
        return None if found is None else found.strip()
    found = _last_answer_tag(response)
    if found is None:
        return None
    found = found.strip()
    if task == "generic" and found.startswith(_BOXED):
        span = _boxed_span(found, 0)
        if span is not None and span[1] == len(found):
            return span[0].strip()
    return found


# ---------------------------------------------------------------------------------------------
# format


def _think_then_box(response: str) -> float:
    """geo3k format, EasyR1's ``<think>.*</think>.*\\\\boxed\\{.*\\}.*`` (DOTALL, full match) done
    with string searches: the earliest ``</think>`` and the earliest box after it are the ones
    that leave the most room for the rest."""
    text = _collapse_tag_spaces(response)
    if not text.startswith(_THINK_OPEN):
        return 0.0
    close = text.find(_THINK_CLOSE, len(_THINK_OPEN))
    box = -1 if close < 0 else text.find(_BOXED, close + len(_THINK_CLOSE))
    found = box >= 0 and text.find("}", box + len(_BOXED)) >= 0
    return 1.0 if found else 0.0


def _has_answer_tag(response: str) -> float:
    close = response.rfind(_ANSWER_CLOSE)
    return 1.0 if close >= 0 and response.rfind(_ANSWER_OPEN, 0, close) >= 0 else 0.0


def _ends_with_single_answer(response: str) -> float:
    """clevr format: one answer pair, last in the response (a think block before it is fine)."""
    text = response.strip()
    if not text.endswith(_ANSWER_CLOSE) or text.count(_ANSWER_OPEN) != 1 or text.count(_ANSWER_CLOSE) != 1:
        return 0.0
    return 1.0


_FORMAT: dict[str, Callable[[str], float]] = {
    "geo3k": _think_then_box,
    "clevr": _ends_with_single_answer,
    "generic": _has_answer_tag,
    "grounding": _has_answer_tag,
    "zoom": _ends_with_single_answer,
    "video": _ends_with_single_answer,
}


# ---------------------------------------------------------------------------------------------
# accuracy


def _math_accuracy(pred: str, gold: str, deadline: float) -> tuple[float, str]:
    equal = grade_answer(pred, gold, deadline=deadline)
    return (1.0, "") if equal else (0.0, "wrong_answer")


def _geo3k_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    pred = extract_final_answer(response, "geo3k")
    if not pred:
        return 0.0, "no_answer_found"
    return _math_accuracy(pred, gold, deadline)


def _as_integer(text: str) -> int | None:
    match = _INTEGER.fullmatch(text.strip())
    if match is None:
        return None
    digits = match.group(0).split(".")[0]
    # int() refuses more than 4300 digits (and would be slow well before); no count is that long
    return int(digits) if len(digits) <= MAX_INTEGER_DIGITS else None


def _clevr_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    gold_int = _as_integer(gold)
    if gold_int is None:
        return 0.0, "invalid_gold_answer"
    pred = extract_final_answer(response, "clevr")
    if pred is None:
        return 0.0, "no_answer_found"
    pred_int = _as_integer(pred)
    if pred_int is None:
        return 0.0, "unparseable_answer"
    return (1.0, "") if pred_int == gold_int else (0.0, "wrong_answer")


def _generic_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    pred = extract_final_answer(response, "generic")
    if pred is None or not pred:
        return 0.0, "no_answer_found"
    if _loose_text(pred) == _loose_text(gold):
        return 1.0, ""
    return _math_accuracy(pred, gold, deadline)


def _zoom_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    pred = extract_final_answer(response, "zoom")
    if not pred:
        return 0.0, "no_answer_found"
    return (1.0, "") if _loose_text(pred) == _loose_text(gold) else (0.0, "wrong_answer")


def _video_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    pred = extract_final_answer(response, "video")
    if not pred:
        return 0.0, "no_answer_found"
    gold = gold.strip()
    if _OPTION_LETTER.fullmatch(gold):
        letter = _OPTION_CHOICE.match(pred)
        if letter is None:
            return 0.0, "unparseable_answer"
        return (1.0, "") if letter.group(1) == gold.strip("()").upper() else (0.0, "wrong_answer")
    if _NUMBER.fullmatch(gold) and len(gold) <= MAX_INTEGER_DIGITS:
        if not (_NUMBER.fullmatch(pred) and len(pred) <= MAX_INTEGER_DIGITS):
            return 0.0, "unparseable_answer"
        return (1.0, "") if float(pred) == float(gold) else (0.0, "wrong_answer")
    return (1.0, "") if _loose_text(pred) == _loose_text(gold) else (0.0, "wrong_answer")


def _loose_text(text: str) -> str:
    """Free-text form: no ``$``/``\\(``, ``\\text{}`` unwrapped, lower case, single spaces, no
    final period."""
    if len(text) > MAX_ANSWER_CHARS:
        raise MathTooLong(f"answer has {len(text)} characters, more than {MAX_ANSWER_CHARS}")
    text = _LOOSE_TEXT.sub(lambda match: match.group(1), _LOOSE_DROP.sub("", text))
    return " ".join(text.lower().split()).rstrip(".").strip()


def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """The first ``[x1, y1, x2, y2]`` (or ``(...)``) of four numbers in `text`, or None."""
    if len(text) > MAX_ANSWER_CHARS:
        raise MathTooLong(f"box text longer than {MAX_ANSWER_CHARS} characters")
    match = _BOX.search(text)
    return None if match is None else tuple(float(v) for v in match.groups())


def _grounding_accuracy(
    response: str, gold: str, deadline: float, threshold: float | None
) -> tuple[float, str]:
    try:
        gold_box = parse_box(gold)
        if gold_box is not None:
            _check_box(gold_box, "gold box")
    except (ValueError, MathLimitError):
        gold_box = None
    if gold_box is None:
        return 0.0, "invalid_gold_answer"
    pred = extract_final_answer(response, "grounding")
    if pred is None:
        return 0.0, "no_answer_found"
    pred_box = parse_box(pred)
    if pred_box is None:
        return 0.0, "unparseable_answer"
    try:
        overlap = iou(pred_box, gold_box)
    except ValueError:
        return 0.0, "invalid_box"
    if threshold is not None:
        overlap = 1.0 if overlap >= threshold else 0.0
    return overlap, "" if overlap > 0 else "wrong_answer"


_ACCURACY = {
    "geo3k": _geo3k_accuracy,
    "clevr": _clevr_accuracy,
    "generic": _generic_accuracy,
    "grounding": _grounding_accuracy,
    "zoom": _zoom_accuracy,
    "video": _video_accuracy,
}


# ---------------------------------------------------------------------------------------------
# boxes


def _check_box(box: Sequence[float], name: str) -> tuple[float, float, float, float]:
    """Validate ``[x1, y1, x2, y2]`` with finite values, x1 <= x2 and y1 <= y2."""
    values = tuple(float(v) for v in box)
    if len(values) != 4:
        raise ValueError(f"{name} must have 4 values [x1, y1, x2, y2], got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} has a non-finite value: {values}")
    x1, y1, x2, y2 = values
    if x2 < x1 or y2 < y1:
        raise ValueError(f"{name} must satisfy x1 <= x2 and y1 <= y2, got {values}")
    return values


def _area(box: tuple[float, float, float, float]) -> float:
    return (box[2] - box[0]) * (box[3] - box[1])


def _intersection_union(a, b) -> tuple[float, float]:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    return inter, _area(a) + _area(b) - inter


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes, in [0, 1] (0 if both empty)."""
    a, b = _check_box(a, "box a"), _check_box(b, "box b")
    inter, union = _intersection_union(a, b)
    return inter / union if union > 0 else 0.0


def giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalized IoU in [-1, 1]: IoU minus the share of the enclosing box that neither covers."""
    a, b = _check_box(a, "box a"), _check_box(b, "box b")
    inter, union = _intersection_union(a, b)
    enclosing = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    if enclosing <= 0:
        return 0.0
    overlap = inter / union if union > 0 else 0.0
    return overlap - (enclosing - union) / enclosing


# ---------------------------------------------------------------------------------------------
# scoring


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown reward task {task!r}; choose one of: {', '.join(TASKS)}")


def _resolve_weights(task: str, weights: dict | None) -> dict[str, float]:
    resolved = dict(DEFAULT_WEIGHTS[task])
    for key, value in (weights or {}).items():
        if key not in resolved:
            raise ValueError(f"unknown reward weight {key!r}; valid keys: accuracy, format")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ValueError(f"reward weight {key!r} must be a finite number, got {value!r}")
        resolved[key] = float(value)
    return resolved


def _check_arguments(response, answer, timeout_s, task, iou_threshold) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    if iou_threshold is not None:
        if task != "grounding":
            raise ValueError(f"iou_threshold applies to the grounding task only, not {task!r}")
        if not 0 < iou_threshold <= 1:
            raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold!r}")


def score(
    task: str,
    response: str,
    answer: str,
    *,
    weights: dict | None = None,
    timeout_s: float = 2.0,
    iou_threshold: float | None = None,
) -> RewardResult:
    """Reward of one `response` against the gold `answer` for `task` (see the module docstring).

    `weights` overrides the task's {"accuracy", "format"} weights (missing keys keep their
    defaults). `iou_threshold` (grounding only) turns IoU into a 0/1 hit. Never raises for any
    response text; raises ValueError/TypeError for an unknown task or bad arguments.
    """
    _check_task(task)
    resolved = _resolve_weights(task, weights)
    _check_arguments(response, answer, timeout_s, task, iou_threshold)
    deadline = time.monotonic() + timeout_s
    try:
        fmt = _FORMAT[task](response)
        check_deadline(deadline)
        accuracy, reason = _ACCURACY[task](response, answer, deadline, iou_threshold)
    except MathTimeout:
        return RewardResult(0.0, 0.0, 0.0, "timeout")
    except MathTooLong:
        return RewardResult(0.0, 0.0, 0.0, "answer_too_long")
    if not reason and fmt < 1.0:
        reason = "bad_format"
    total = resolved["accuracy"] * accuracy + resolved["format"] * fmt
    return RewardResult(total, accuracy, fmt, reason)


def score_batch(
    task: str, responses: Sequence[str], answers: Sequence[str], **kwargs
) -> list[RewardResult]:
    """`score` for each (response, answer) pair; keyword arguments go to every call."""
    if len(responses) != len(answers):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
    return [score(task, r, a, **kwargs) for r, a in zip(responses, answers)]


# ---------------------------------------------------------------------------------------------
# CLI


def _build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data.rewards", description="Score one response; prints a JSON object."
    )
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)}")
    parser.add_argument("--response", required=True, help="the model's response text")
    parser.add_argument("--answer", required=True, help="the gold answer")
    parser.add_argument("--weights", help='JSON object, e.g. \'{"accuracy": 0.9, "format": 0.1}\'')
    parser.add_argument("--iou-threshold", type=float, help="grounding: 0/1 accuracy at this IoU")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline per call (seconds)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; exits with status 2 (argparse's usage error) for bad arguments."""
    parser = _build_arg_parser()
    args = parser.parse_args(argv)
    if args.task not in TASKS:
        parser.error(f"unknown task {args.task!r}; choose one of: {', '.join(TASKS)}")
    weights = None
    if args.weights:
        try:
            weights = json.loads(args.weights)
        except json.JSONDecodeError as error:
            parser.error(f"--weights is not valid JSON: {error}")
        if not isinstance(weights, dict):
            parser.error("--weights must be a JSON object")
    try:
        result = score(
            args.task,
            args.response,
            args.answer,
            weights=weights,
            timeout_s=args.timeout_s,
            iou_threshold=args.iou_threshold,
        )
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
