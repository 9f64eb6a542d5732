"""Math answer grading: mathruler's rules, with a bounded evaluator in place of sympy.

`grade_answer(pred, gold)` decides as `mathruler.grader.grade_answer` does (the geo3k reward of
EasyR1, from OpenAI's PRM800K grader), step by step:

1. equal after mathruler's MATH-style normalization (``\\dfrac`` → ``\\frac``, ``\\left`` and
   units after ``\\text{ `` dropped, ``k = 5`` → ``5``, ``0.5`` → ``\\frac{1}{2}``, ``a/b`` →
   ``\\frac{a}{b}``) → correct;
2. equal after mathruler's second normalization (LaTeX to text with pylatexenc, ``$``, ``%``,
   ``^\\circ`` and unit words dropped, spaces and braces removed, lower case, ``1,000`` →
   ``1000``) → correct;
3. otherwise both are split into tuple elements (``(1, 2)``); the counts and brackets must match,
   and element by element: two plain fractions must be written identically (``2/4`` ≠ ``1/2``),
   an integer is only equal to an integer (``60`` ≠ ``59.99``), and anything else is equal when
   mathruler would hand it to sympy (at most two distinct letters, no ``^{``/``^(``, no
   multi-digit exponent) and its value is equal.

Only step 3's last test differs in how it is done. mathruler parses the text with sympy's
expression parser, which runs Python's ``eval`` on the model's text, and then calls
``sympy.simplify``, which has no time bound. Here a small parser reads the normalized text
(numbers, ``+ - * / ^ **``, parentheses, ``sqrt``, ``pi``, single-letter variables,
implicit multiplication as sympy's ``implicit_multiplication_application`` reads it) into a tree
and computes floats. Two expressions are equal when their values agree within a relative
`REL_TOL` (1e-14, a few float roundings: exact forms such as ``2sqrt(3)`` and ``sqrt(12)`` agree, a rounded decimal such
as ``3.4641`` does not, as under sympy); with variables, the values must agree at
`_VARIABLE_POINTS` fixed random points (an identity test: ``2x`` = ``x+x``).

Bounds: text longer than `MAX_ANSWER_CHARS` raises `MathTooLong` before any work; a normalized
expression longer than `MAX_EXPR_CHARS`, nesting deeper than `MAX_DEPTH`, an exponent beyond
`MAX_EXPONENT` or a value beyond `MAX_MAGNITUDE` raise `MathLimitError` from the evaluator, and
the grader counts such an answer as not equal (sympy would keep a nonzero difference); the parser
counts its steps and compares `time.monotonic()` with the caller's deadline, raising
`MathTimeout`. The normalizations are mathruler's own string functions: regular expressions and
pylatexenc's parser over at most `MAX_ANSWER_CHARS` characters (well under a second for the worst
inputs measured, see tests/test_rewards.py). No signals are used, so any thread works.
"""

from __future__ import annotations

import logging
import math
import random
import re
import time

from mathruler import grader as _mathruler
from mathruler.math_normalize import normalize_answer as _mathd_normalize

MAX_ANSWER_CHARS = 1000  # longest answer text accepted at all
MAX_EXPR_CHARS = 300  # longest normalized expression the evaluator reads
MAX_DEPTH = 40  # nested groups / unary signs / exponents
MAX_EXPONENT = 64  # |exponent| bound for '^'
MAX_MAGNITUDE = 1e100  # bound on every intermediate value
MAX_STEPS = 20_000  # parser steps, a second line of defence behind MAX_EXPR_CHARS
REL_TOL = 1e-14  # values agree within this relative difference (float rounding only)
ABS_TOL = 1e-14  # and this absolute one, so that 0 can be matched
_CLOCK_EVERY = 32
_VARIABLE_POINTS = 3

# mathruler's test of whether sympy may try an expression (letter count, exponent forms)
_mathruler_would_try = _mathruler.should_allow_eval

# pylatexenc logs a warning for every malformed macro it meets; model output has many.
logging.getLogger("pylatexenc").setLevel(logging.ERROR)


class MathParseError(ValueError):
    """The text is not an expression the evaluator reads (or has no real value)."""


class MathLimitError(MathParseError):
    """The text exceeds a size, depth, exponent or magnitude bound."""


class MathTooLong(MathLimitError):
    """The text is longer than `MAX_ANSWER_CHARS` (raw) or `MAX_EXPR_CHARS` (normalized)."""


class MathTimeout(MathLimitError):
    """The deadline passed while the text was being read."""


def check_deadline(deadline: float | None) -> None:
    """Raise `MathTimeout` when `deadline` (a `time.monotonic()` value) has passed."""
    if deadline is not None and time.monotonic() > deadline:
        raise MathTimeout("deadline passed")


# ---------------------------------------------------------------------------------------------
# the evaluator: text -> tree -> float

_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+(?![A-Za-z]))?")


def _bounded(value: float) -> float:
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise MathLimitError(f"intermediate value beyond ±{MAX_MAGNITUDE:g}")
    return value


def _power(base: float, exponent: float) -> float:
    """base ** exponent for real values, refusing anything huge before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise MathLimitError(f"exponent {exponent:g} beyond ±{MAX_EXPONENT}")
    if base == 0.0:
        if exponent < 0:
            raise MathParseError("zero raised to a negative power")
        return 1.0 if exponent == 0 else 0.0
    if base < 0 and not float(exponent).is_integer():
        raise MathParseError("negative base with a fractional exponent has no real value")
    if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise MathLimitError(f"power beyond ±{MAX_MAGNITUDE:g}")
    return _bounded(base**exponent)


def _sqrt(value: float) -> float:
    if value < 0:
        raise MathParseError("square root of a negative number has no real value")
    return math.sqrt(value)


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


class _Parser:
    """Recursive descent over a normalized expression; nodes are tuples (see `_value`).

    expr := term (('+'|'-') term)* ; term := signed (('*'|'/') signed | implicit)* ;
    signed := ('+'|'-') signed | power ; power := atom (('^'|'**') signed)? ;
    atom := number | '(' expr ')' | 'sqrt' atom | 'pi' | letter.
    """

    def __init__(self, text: str, deadline: float | None):
        self.text, self.pos, self.steps, self.depth, self.deadline = text, 0, 0, 0, deadline

    def _tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise MathLimitError(f"more than {MAX_STEPS} parser steps")
        if self.steps % _CLOCK_EVERY == 1:
            check_deadline(self.deadline)

    def _peek(self, width: int = 1) -> str:
        self._tick()
        return self.text[self.pos : self.pos + width]

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MathLimitError(f"nesting deeper than {MAX_DEPTH}")

    def parse(self) -> tuple:
        tree = self.expr()
        if self.pos != len(self.text):
            raise MathParseError(f"unexpected {self.text[self.pos]!r} at position {self.pos}")
        return tree

    def expr(self) -> tuple:
        self._enter()
        tree = self.term()
        while (op := self._peek()) in ("+", "-") and op:
            self.pos += 1
            tree = (op, tree, self.term())
        self.depth -= 1
        return tree

    def term(self) -> tuple:
        tree = self.signed()
        while True:
            if self._peek(2) != "**" and self._peek() in ("*", "/") and self._peek():
                op = self._peek()
                self.pos += 1
                tree = (op, tree, self.signed())
            elif self._starts_atom() and not self._starts_number():
                tree = ("*", tree, self.power())  # 2x, 2sqrt(3), 2(3+1), (1)(2)
            elif self._starts_number() and self.text[self.pos - 1] == ")":
                tree = ("*", tree, self.power())  # (2)3
            else:
                return tree

    def _starts_number(self) -> bool:
        char = self._peek()
        return bool(char) and (char.isascii() and char.isdigit() or char == ".")

    def _starts_atom(self) -> bool:
        char = self._peek()
        return bool(char) and (char == "(" or char.isascii() and char.isalpha()) or self._starts_number()

    def signed(self) -> tuple:
        op = self._peek()
        if op in ("+", "-") and op:
            self.pos += 1
            self._enter()
            tree = self.signed()
            self.depth -= 1
            return ("neg", tree) if op == "-" else tree
        return self.power()

    def power(self) -> tuple:
        base = self.atom()
        if self._peek(2) == "**":
            self.pos += 2
        elif self._peek() == "^":
            self.pos += 1
        else:
            return base
        self._enter()
        exponent = self.signed()
        self.depth -= 1
        return ("^", base, exponent)

    def atom(self) -> tuple:
        if self._starts_number():
            match = _NUMBER.match(self.text, self.pos)
            if match is None:
                raise MathParseError(f"malformed number at position {self.pos}")
            self.pos = match.end()
            return ("num", _bounded(float(match.group(0))))
        if self._peek() == "(":
            self.pos += 1
            tree = self.expr()
            if self._peek() != ")":
                raise MathParseError(f"expected ')' at position {self.pos}")
            self.pos += 1
            return tree
        if self._peek(4) == "sqrt":
            self.pos += 4
            self._enter()
            tree = ("sqrt", self.atom())
            self.depth -= 1
            return tree
        if self._peek(2) == "pi":
            self.pos += 2
            return ("num", math.pi)
        char = self._peek()
        if char and char.isascii() and char.isalpha():
            self.pos += 1
            return ("var", char)
        raise MathParseError(f"unexpected {char or 'end of text'!r} at position {self.pos}")


def parse(text: str, *, deadline: float | None = None) -> tuple:
    """The expression tree of a normalized expression (see `_Parser`); raises `MathParseError`."""
    if len(text) > MAX_EXPR_CHARS:
        raise MathTooLong(f"expression has {len(text)} characters (limit {MAX_EXPR_CHARS})")
    if not text:
        raise MathParseError("empty expression")
    return _Parser(text, deadline).parse()


def variables(tree: tuple) -> set[str]:
    """Names of the variables in `tree`."""
    if tree[0] == "var":
        return {tree[1]}
    if tree[0] == "num":
        return set()
    return set().union(*(variables(child) for child in tree[1:]))


def value(tree: tuple, env: dict[str, float] | None = None) -> float:
    """The value of `tree` with variables from `env`; raises `MathParseError` / `MathLimitError`."""
    kind = tree[0]
    if kind == "num":
        return tree[1]
    if kind == "var":
        if not env or tree[1] not in env:
            raise MathParseError(f"variable {tree[1]!r} has no value")
        return env[tree[1]]
    if kind == "neg":
        return -value(tree[1], env)
    if kind == "sqrt":
        return _sqrt(value(tree[1], env))
    left, right = value(tree[1], env), value(tree[2], env)
    if kind == "^":
        return _power(left, right)
    if kind == "/" and right == 0:
        raise MathParseError("division by zero")
    return _bounded(_BINARY[kind](left, right))


def evaluate(text: str, *, deadline: float | None = None) -> float:
    """The value of a normalized expression without variables."""
    return value(parse(text, deadline=deadline))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def expressions_equal(a: str, b: str, *, deadline: float | None = None) -> bool:
    """Whether two normalized expressions have the same value (at every test point, when they
    have variables). Raises `MathParseError` when either cannot be read or has no value."""
    tree_a, tree_b = parse(a, deadline=deadline), parse(b, deadline=deadline)
    names = sorted(variables(tree_a) | variables(tree_b))
    if not names:
        return _close(value(tree_a), value(tree_b))
    rng = random.Random(0)
    for _ in range(_VARIABLE_POINTS):
        env = {name: rng.uniform(1.1, 3.7) for name in names}
        if not _close(value(tree_a, env), value(tree_b, env)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# grading


def _elements_equal(gold: str, pred: str, deadline: float | None) -> bool:
    """Step 3 of the module docstring for one tuple element."""
    if _mathruler._is_frac(gold) and _mathruler._is_frac(pred):
        return gold == pred  # unreduced fractions are not accepted for reduced ones
    if _mathruler._str_is_int(gold) != _mathruler._str_is_int(pred):
        return False
    if not _mathruler_would_try(f"({gold})-({pred})"):
        return False
    try:
        return expressions_equal(gold, pred, deadline=deadline)
    except (MathTimeout, MathTooLong):
        raise
    except MathParseError:
        # Unreadable, no real value, or beyond the depth/exponent/magnitude bounds: where sympy
        # fails to parse or keeps a nonzero difference, the answer is not equal either.
        return False


def _check_length(text: str, name: str) -> None:
    if len(text) > MAX_ANSWER_CHARS:
        raise MathTooLong(f"{name} has {len(text)} characters, more than {MAX_ANSWER_CHARS}")


def grade_answer(pred: str, gold: str, *, deadline: float | None = None) -> bool:
    """Whether `pred` is a correct answer for `gold`, by mathruler's rules (module docstring).

    Raises `MathTooLong` for texts over `MAX_ANSWER_CHARS` and `MathTimeout` when `deadline`
    passes; never evaluates either text as code.
    """
    _check_length(pred, "answer")
    _check_length(gold, "gold answer")
    if _mathd_normalize(gold) == _mathd_normalize(pred):
        return True
    check_deadline(deadline)
    gold_norm, pred_norm = _mathruler._normalize(gold), _mathruler._normalize(pred)
    check_deadline(deadline)
    if gold_norm == pred_norm:
        return True
    if not pred_norm:
        return False
    gold_elems, pred_elems = _mathruler.split_tuple(gold_norm), _mathruler.split_tuple(pred_norm)
    if len(gold_elems) > 1 and (gold_norm[0] != pred_norm[0] or gold_norm[-1] != pred_norm[-1]):
        return False
    if len(gold_elems) != len(pred_elems):
        return False
    return all(_elements_equal(g, p, deadline) for g, p in zip(gold_elems, pred_elems))
