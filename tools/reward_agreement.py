"""Agreement of vlrl's geo3k reward with EasyR1's (mathruler-based) on a fixed corpus.

    python tools/reward_agreement.py [--n-generated 300] [--seed 0] [--show-all] [--math-verify]
                                     [--other-data DIR]

The reference is EasyR1's ``examples/reward_function/math.py``: spaces around ``<``, ``>``
and ``/`` removed, format ``re.fullmatch(r"<think>.*</think>.*\\boxed\\{.*\\}.*", DOTALL)``,
accuracy ``mathruler.grader.grade_answer(extract_boxed_content(response), answer)``, score
0.9·accuracy + 0.1·format. It runs here as EasyR1 runs it (sympy parses the answers), in a child
process with a time limit per pair, since some pairs make it backtrack or simplify for minutes.
The corpus is every geo3k (response, answer) pair of tests/test_rewards.py and
tests/test_bad_inputs.py plus generated pairs in Geometry3K's answer forms (integers, decimals,
fractions, roots, multiples of pi, degrees), each answered correctly in another written form,
approximately, wrongly or malformed. Prints one line per disagreement and a JSON summary line;
exits 1 when accuracy agreement is below --min-agreement. --math-verify adds math-verify's
verdict on the same pairs (``pip install math-verify``); --other-data DIR adds the geo3k score of
the ``data`` package found in DIR (another checkout, e.g. ``git archive OLD data | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REFERENCE_TIMEOUT_S = 10.0

# ---------------------------------------------------------------------------------------------
# the reference


def _easyr1_score(response: str, answer: str) -> dict:
    """EasyR1's math reward for one pair (runs in the child process)."""
    import logging

    from mathruler.grader import extract_boxed_content, grade_answer

    logging.disable(logging.WARNING)
    text = re.sub(r"\s*(<|>|/)\s*", r"\1", response)
    fmt = 1.0 if re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", text, re.DOTALL) else 0.0
    accuracy = 1.0 if grade_answer(extract_boxed_content(text), answer) else 0.0
    return {"score": 0.9 * accuracy + 0.1 * fmt, "accuracy": accuracy, "format": fmt}


def _math_verify_accuracy(response: str, answer: str) -> float:
    """math-verify's verdict on the last boxed answer, LaTeX extraction only (child process)."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(f"${answer}$", extraction_config=[LatexExtractionConfig()])
    pred = parse(response, extraction_config=[LatexExtractionConfig()])
    return 1.0 if verify(gold, pred) else 0.0


def _other_score(data_dir: str, response: str, answer: str) -> dict:
    """geo3k score of the `data` package in `data_dir` (child process, so it cannot mix)."""
    if sys.path[0] != data_dir:
        sys.path.insert(0, data_dir)
    from data.rewards import score

    result = score("geo3k", response, answer)
    return {"score": result.score, "accuracy": result.accuracy, "format": result.format}


class _Child:
    """One worker process; a pair that overruns the limit kills it and counts as a hang."""

    def __init__(self):
        self.pool = multiprocessing.get_context("spawn").Pool(1)

    def run(self, fn, *args):
        try:
            return self.pool.apply_async(fn, args).get(REFERENCE_TIMEOUT_S)
        except multiprocessing.TimeoutError:
            self.pool.terminate()
            self.pool = multiprocessing.get_context("spawn").Pool(1)
            return None

    def close(self):
        self.pool.terminate()


# ---------------------------------------------------------------------------------------------
# the corpus


def _marked(test_fn, argnames: str) -> list:
    """The parameter values of a pytest.mark.parametrize on `test_fn` with these argnames."""
    for mark in getattr(test_fn, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0].replace(" ", "") == argnames:
            return list(mark.args[1])
    raise LookupError(f"{test_fn.__name__} has no parametrize over {argnames}")


def pairs_from_tests() -> list[tuple[str, str, str]]:
    """(origin, response, answer) for every geo3k case of the reward tests."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_bad_inputs as bad
    import test_rewards as tr

    pairs = []
    for pred, gold in _marked(tr.test_geo3k_equivalent_answers_score_full, "pred,gold"):
        pairs.append(("tests:equivalent", tr.geo(pred), gold))
    for pred, gold in _marked(tr.test_geo3k_wrong_answers_score_low, "pred,gold"):
        pairs.append(("tests:wrong", tr.geo(pred), gold))
    for response in _marked(tr.test_geo3k_format_accepted, "response"):
        pairs.append(("tests:format_accepted", response, "5"))
    for response in _marked(tr.test_geo3k_format_rejected, "response"):
        pairs.append(("tests:format_rejected", response, "5"))
    for response in _marked(tr.test_pathological_inputs_finish_fast, "response"):
        pairs.append(("tests:pathological", response, "1"))
    pairs += [("tests:misc", tr.geo("abc"), "5"), ("tests:misc", "<think>so 5</think> five", "5")]
    for nasty in bad.NASTY:
        pairs.append(("tests:nasty_answer", f"<think>hmm</think>\\boxed{{{nasty}}}", "3.5"))
        pairs.append(("tests:nasty_gold", "<think>ok</think>\\boxed{3.5}", nasty))
    return pairs


def _gold_forms(rng: random.Random) -> tuple[str, float, list[str]]:
    """A Geometry3K-style gold answer, its value and other correct ways to write it."""
    kind = rng.choice(["int", "decimal", "frac", "root", "frac_root", "pi", "degree"])
    a, b, c = rng.randint(1, 60), rng.choice([2, 3, 5, 6, 7, 10, 11]), rng.randint(2, 9)
    if kind == "int":
        return str(a), a, [f"{a}.0", f"x = {a}", f"{a}\\text{{ cm}}", f"{a} units"]
    if kind == "decimal":
        v = round(a + rng.randint(1, 99) / 100, rng.choice([1, 2]))
        return str(v), v, [f"{v}0", f"x={v}", f"{v} \\mathrm{{cm}}", f"AB = {v}"]
    if kind == "frac":
        while a % c == 0:
            a += 1
        v = a / c
        return f"\\frac{{{a}}}{{{c}}}", v, [f"{a}/{c}", f"\\dfrac{{{a}}}{{{c}}}", f"\\tfrac{{{a}}}{{{c}}}",
                                          f"{v:.12g}", f"\\frac{{{2 * a}}}{{{2 * c}}}"]
    if kind == "root":
        v = a * b**0.5
        return f"{a}\\sqrt{{{b}}}", v, [f"{a} \\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"{a}\\sqrt{b}",
                                      f"{a}*\\sqrt{{{b}}}", f"{v:.4f}"]
    if kind == "frac_root":
        v = a * b**0.5 / c
        return f"\\frac{{{a}\\sqrt{{{b}}}}}{{{c}}}", v, [f"\\frac{{{a}}}{{{c}}}\\sqrt{{{b}}}",
                                                      f"{a}\\sqrt{{{b}}}/{c}", f"{v:.2f}"]
    if kind == "pi":
        v = a * 3.141592653589793
        return f"{a}\\pi", v, [f"{a} \\pi", f"\\pi {a}", f"{a}\\cdot\\pi", f"{v:.2f}"]
    return str(a * 2), a * 2, [f"{a * 2}^\\circ", f"{a * 2}^{{\\circ}}", f"{a * 2}°", f"{a * 2} degrees"]


def _wrong_forms(rng: random.Random, gold: str, v: float) -> list[str]:
    return [f"{v + 1:g}", f"{v * 2:.6g}", f"{v:.1f}", gold.replace("2", "3") if "2" in gold else f"{v - 1:g}",
            "", "\\frac{1}{", "3, 4", "\\infty", f"-{gold}"]


def _wrap(rng: random.Random, pred: str) -> str:
    """A response around `pred` in one of the layouts models produce."""
    layouts = [
        "<think>reasoning</think> \\boxed{{{p}}}",
        "<think>\nreasoning\n</think>\n\n\\boxed{{{p}}}",
        "<think>r</think> The answer is \\boxed{{{p}}}.",
        "< think >r< / think > \\boxed{{{p}}}",
        "\\boxed{{{p}}}",
        "<think>r</think><answer>{p}</answer>",
        "<think>r \\boxed{{0}}</think> \\boxed{{{p}}}",
        "<think>r</think> \\boxed{{{p}}} wait \\boxed{{0}}",
        "<think>r</think> \\boxed{{{p}",
        "So the answer is \\boxed{{{p}}} <think>late</think>",
    ]
    weights = [8, 3, 3, 1, 1, 1, 1, 1, 1, 1]
    return rng.choices(layouts, weights)[0].format(p=pred)


def generated_pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
    """`n` generated (origin, response, answer) pairs; the same seed gives the same pairs."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        gold, v, right = _gold_forms(rng)
        choice = rng.random()
        if choice < 0.2:
            pred, origin = gold, "generated:same"
        elif choice < 0.65:
            pred, origin = rng.choice(right), "generated:rewritten"
        else:
            pred, origin = rng.choice(_wrong_forms(rng, gold, v)), "generated:wrong"
        pairs.append((origin, _wrap(rng, pred), gold))
    return pairs


# ---------------------------------------------------------------------------------------------
# comparison


def compare(pairs, with_math_verify: bool, other_data: str | None):
    """Rows of (origin, response, answer, ours, reference[, math_verify_accuracy][, other])."""
    from data.rewards import score

    child, other_child = _Child(), _Child() if other_data else None
    rows = []
    try:
        for origin, response, answer in pairs:
            ours = score("geo3k", response, answer)
            ref = child.run(_easyr1_score, response, answer)
            row = {"origin": origin, "response": response, "answer": answer,
                   "ours": {"score": ours.score, "accuracy": ours.accuracy, "format": ours.format,
                            "reason": ours.reason}, "reference": ref}
            if with_math_verify:
                row["math_verify_accuracy"] = child.run(_math_verify_accuracy, response, answer)
            if other_data:
                row["other"] = other_child.run(_other_score, other_data, response, answer)
            rows.append(row)
    finally:
        child.close()
        if other_child:
            other_child.close()
    return rows


def _agree(row, key: str, scorer: str = "ours") -> bool:
    ref, mine = row["reference"], row.get(scorer)
    return ref is not None and mine is not None and abs(mine[key] - ref[key]) < 1e-9


def summarize(rows, with_math_verify: bool, other_data: str | None) -> dict:
    n = len(rows)
    summary = {"pairs": n, "from_tests": sum(r["origin"].startswith("tests") for r in rows),
               "reference_hangs": sum(r["reference"] is None for r in rows)}
    for key in ("accuracy", "format", "score"):
        summary[f"{key}_agreement"] = sum(_agree(r, key) for r in rows) / n
    if with_math_verify:
        judged = [r for r in rows if r["reference"] and r["math_verify_accuracy"] is not None]
        agree = sum(r["math_verify_accuracy"] == r["reference"]["accuracy"] for r in judged)
        summary["math_verify_accuracy_agreement"] = agree / n
    if other_data:
        for key in ("accuracy", "format", "score"):
            summary[f"other_{key}_agreement"] = sum(_agree(r, key, "other") for r in rows) / n
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-generated", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-all", action="store_true", help="print agreeing pairs too")
    parser.add_argument("--math-verify", action="store_true", help="also score with math-verify")
    parser.add_argument("--other-data", help="also score with the data/ package in this folder")
    parser.add_argument("--min-agreement", type=float, default=0.0)
    args = parser.parse_args(argv)
    pairs = pairs_from_tests() + generated_pairs(args.n_generated, args.seed)
    other = str(Path(args.other_data).resolve()) if args.other_data else None
    rows = compare(pairs, args.math_verify, other)
    for row in rows:
        if args.show_all or not all(_agree(row, k) for k in ("accuracy", "format")):
            shown = {k: (v[:120] + "..." if isinstance(v, str) and len(v) > 120 else v)
                     for k, v in row.items()}
            print(json.dumps(shown, ensure_ascii=False))
    summary = summarize(rows, args.math_verify, other)
    print(json.dumps(summary))
    return 0 if summary["accuracy_agreement"] >= args.min_agreement else 1


if __name__ == "__main__":
    sys.exit(main())
