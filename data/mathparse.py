"""Bounded evaluation of short LaTeX / ASCII math answers to floats.

Final answers come from model output, which is untrusted text. Nothing here hands a string to
Python's expression machinery or to a computer-algebra string parser: a small recursive-descent
parser reads the subset that final answers use and computes a float directly.

Grammar, loosest binding first::

    expr    := term (('+' | '-') term)*
    term    := signed (('*' | '/' | \\cdot | \\times | \\div) signed | implicit-factor)*
    signed  := ('+' | '-') signed | power              # -2^2 is -(2^2)
    power   := postfix ('^' signed)?                    # right-associative: 2^3^2 = 2^9
    postfix := atom '%'*                                # percent divides by 100
    atom    := number | '(' expr ')' | '[' expr ']' | '{' expr '}'
             | \\frac A B | \\sqrt A | \\sqrt[n] A | \\pi | pi | π | √ A

Implicit multiplication joins a factor to a following atom that opens with '(', '{', a command,
'π', '√' or 'pi' (``2\\sqrt{3}``, ``4\\pi``, ``3(2+1)``). Two bare numbers are never joined, so
"2 3" is an error rather than 6. ``\\frac12`` and ``\\sqrt3`` take one-digit arguments as in LaTeX.

`normalize_answer` first strips what is not part of the value: ``$`` and display delimiters,
``\\left``/``\\right`` and spacing commands, degree marks (``60^\\circ`` and ``60°`` are 60),
unit words in ``\\text{...}`` or at the end (``5\\text{ cm}^2`` is 5), a leading ``x =``,
thousands separators (``1,000`` and ``1{,}000``); ``\\dfrac``/``\\tfrac``/``\\cfrac`` become
``\\frac``.

Guarantee: the work per call is bounded independently of the input. Text longer than
`MAX_RAW_CHARS` is rejected before any processing beyond a length check; after normalization an
expression longer than `MAX_EXPR_CHARS` is rejected; nesting deeper than `MAX_DEPTH` is rejected
(so the recursion stays far from Python's limit); an exponent with absolute value above
`MAX_EXPONENT`, or any intermediate value whose magnitude would exceed `MAX_MAGNITUDE`, is
rejected before it is computed. All of these raise `MathLimitError` (`MathTooLong` for the
lengths). Finally the parser counts its steps (at most `MAX_STEPS`) and every `_CLOCK_EVERY`
steps compares `time.monotonic()` with an optional deadline, raising `MathTimeout`; this works in
any thread because it uses no signals.
"""

from __future__ import annotations

import math
import re
import time

MAX_RAW_CHARS = 1000  # longest answer text accepted at all
MAX_EXPR_CHARS = 200  # longest expression after normalization
MAX_DEPTH = 40  # nested groups / unary signs / exponents
MAX_EXPONENT = 64  # |exponent| bound for '^'
MAX_MAGNITUDE = 1e100  # bound on every intermediate value
MAX_STEPS = 20_000  # parser steps; far above what MAX_EXPR_CHARS allows, a second line of defence
REL_TOL = 1e-4  # relative tolerance of numeric equality
ABS_TOL = 1e-9  # absolute tolerance, so that a gold answer of 0 can be matched
_CLOCK_EVERY = 32


class MathParseError(ValueError):
    """The text is not an expression of the supported subset (or has no real value)."""


class MathLimitError(MathParseError):
    """The text exceeds a size, depth, exponent or magnitude bound."""


class MathTooLong(MathLimitError):
    """The text is longer than `MAX_RAW_CHARS` (raw) or `MAX_EXPR_CHARS` (normalized)."""


class MathTimeout(MathLimitError):
    """The deadline passed while the text was being evaluated."""


def check_deadline(deadline: float | None) -> None:
    """Raise `MathTimeout` when `deadline` (a `time.monotonic()` value) has passed."""
    if deadline is not None and time.monotonic() > deadline:
        raise MathTimeout("deadline passed")


# ---------------------------------------------------------------------------------------------
# normalization

# Every pattern below is free of nested quantifiers, so matching is linear in the (capped) text.
_DELIMITERS = re.compile(r"\\[()\[\]]|\\?\$")
_SPACING = re.compile(
    r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle|textstyle)(?![A-Za-z])\.?"
    r"|\\[,;:! ]|\\q?quad(?![A-Za-z])|~"
)
_DEGREE = re.compile(r"\^\s*\{\s*\\(?:circ|degree)\s*\}|\^?\s*\\(?:circ|degree)(?![A-Za-z])|°")
_TEXT_CMD = re.compile(
    r"\\(?:text|textrm|textnormal|mathrm|mbox|textbf|mathbf|operatorname)\s*\{([^{}]*)\}"
    r"(\s*\^\s*\{?\s*[23]\s*\}?|[²³])?"
)
_UNIT_WORDS = (
    r"(?:square\s+|sq\.?\s*)?(?:cm|mm|km|m|in|inch|inches|ft|feet|foot|yd|yard|yards|units?"
    r"|degrees?|deg|radians?|rad)"
)
_UNIT_ONLY = re.compile(r"\s*" + _UNIT_WORDS + r"\s*\.?\s*")
_TRAILING_UNIT = re.compile(
    r"(?<=[\d}).\s])\s*" + _UNIT_WORDS + r"(?:\s*\^\s*\{?\s*[23]\s*\}?|[²³])?\s*\.?\s*$", re.ASCII
)
_RELATION = re.compile(r"=|\\approx(?![A-Za-z])|≈")
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])", re.ASCII)
_FRAC_ALIASES = re.compile(r"\\[dtc]frac(?![A-Za-z])")
_UNICODE = str.maketrans({"−": "-", "–": "-", "×": "*", "·": "*", "÷": "/", "∗": "*"})
_PLAIN_DECIMAL = re.compile(r"[+-]?\d*\.(\d+)", re.ASCII)


def _drop_unit_text(match: re.Match) -> str:
    """Remove ``\\text{cm}^2``-style units; keep the content of any other ``\\text{...}``."""
    content = match.group(1)
    if _UNIT_ONLY.fullmatch(content) or not content.strip():
        return ""
    return content + (match.group(2) or "")


def normalize_answer(text: str) -> str:
    """Strip delimiters, spacing, degree marks, units, ``x =`` and thousands separators.

    Raises `MathLimitError` when `text` is longer than `MAX_RAW_CHARS`.
    """
    if len(text) > MAX_RAW_CHARS:
        raise MathTooLong(f"answer has {len(text)} characters, more than {MAX_RAW_CHARS}")
    s = text.translate(_UNICODE)
    s = _DELIMITERS.sub("", s)
    s = _SPACING.sub("", s)  # "" not " ": "1\\,000" is a thousands separator
    s = _DEGREE.sub("", s)
    s = _TEXT_CMD.sub(_drop_unit_text, s)
    s = _RELATION.split(s)[-1]  # "x = 5" and "AB \approx 3.2" keep the right-hand side
    s = s.replace("\\%", "%").replace("{,}", "")
    s = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), s)
    s = " ".join(s.split())
    s = _TRAILING_UNIT.sub("", s)
    s = _FRAC_ALIASES.sub(r"\\frac", s)
    return s.strip().rstrip(".").strip()


def normalize_text(text: str) -> str:
    """Loose string form for non-numeric answers: no ``$``/``\\text``, lower case, single spaces."""
    if len(text) > MAX_RAW_CHARS:
        raise MathTooLong(f"answer has {len(text)} characters, more than {MAX_RAW_CHARS}")
    s = _DELIMITERS.sub("", text)
    s = _TEXT_CMD.sub(lambda m: m.group(1) + (m.group(2) or ""), s)
    s = " ".join(s.lower().split())
    return s.rstrip(".").strip()


def decimal_places(text: str) -> int | None:
    """Digits after the point when `text` normalizes to a plain decimal like "25.1", else None."""
    match = _PLAIN_DECIMAL.fullmatch(normalize_answer(text))
    return len(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------------
# parser

_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_COMMAND = re.compile(r"\\([A-Za-z]+|%)")
_FRAC_NAMES = {"frac", "dfrac", "tfrac", "cfrac"}
_MUL_COMMANDS = {"cdot": "*", "times": "*", "div": "/", "ast": "*"}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _is_digit(char: str) -> bool:
    """ASCII digits only: str.isdigit also accepts '²', which float() rejects."""
    return len(char) == 1 and "0" <= char <= "9"


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


def _root(value: float, degree: float) -> float:
    if not float(degree).is_integer() or not 2 <= degree <= MAX_EXPONENT:
        raise MathParseError(f"root degree must be a whole number in [2, {MAX_EXPONENT}]")
    if value < 0:
        if int(degree) % 2 == 0:
            raise MathParseError("even root of a negative number has no real value")
        return -(abs(value) ** (1.0 / degree))
    return value ** (1.0 / degree)


class _Parser:
    """One pass over one expression; see the module docstring for the grammar."""

    def __init__(self, text: str, deadline: float | None):
        self.text = text
        self.pos = 0
        self.steps = 0
        self.depth = 0
        self.deadline = deadline

    # -- low level --------------------------------------------------------------------------
    def _tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise MathLimitError(f"more than {MAX_STEPS} parser steps")
        if self.steps % _CLOCK_EVERY == 1:
            check_deadline(self.deadline)

    def _peek(self) -> str:
        """Next non-space character ('' at the end), without consuming it."""
        self._tick()
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _peek_command(self) -> str | None:
        """Name of the command at the cursor (after spaces), without consuming it."""
        if self._peek() != "\\":
            return None
        match = _COMMAND.match(self.text, self.pos)
        return match.group(1) if match else None

    def _take_command(self) -> str:
        match = _COMMAND.match(self.text, self.pos)
        if match is None:
            raise MathParseError(f"stray backslash at position {self.pos}")
        self.pos = match.end()
        return match.group(1)

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            found = self._peek() or "end of text"
            raise MathParseError(f"expected {char!r} at position {self.pos}, found {found!r}")
        self.pos += 1

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise MathLimitError(f"nesting deeper than {MAX_DEPTH}")

    # -- grammar ----------------------------------------------------------------------------
    def parse(self) -> float:
        value = self.expr()
        if self._peek():
            raise MathParseError(f"unexpected {self._peek()!r} at position {self.pos}")
        return value

    def expr(self) -> float:
        self._enter()
        value = self.term()
        while (char := self._peek()) in ("+", "-"):
            self.pos += 1
            rhs = self.term()
            value = _bounded(value + rhs if char == "+" else value - rhs)
        self.depth -= 1
        return value

    def term(self) -> float:
        value = self.signed()
        while True:
            op = self._multiplicative_op()
            if op is None and self._starts_implicit_factor():
                op = "*"
                rhs = self.power()  # no sign: "2 -3" stays a subtraction
            elif op is not None:
                rhs = self.signed()
            else:
                return value
            if op == "/" and rhs == 0:
                raise MathParseError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)

    def _multiplicative_op(self) -> str | None:
        """Consume and return '*' or '/' when an explicit operator is next."""
        char = self._peek()
        if char in ("*", "/"):
            self.pos += 1
            return char
        name = self._peek_command()
        if name in _MUL_COMMANDS:
            self._take_command()
            return _MUL_COMMANDS[name]
        return None

    def _starts_implicit_factor(self) -> bool:
        char = self._peek()
        if char in ("(", "{", "π", "√"):
            return True
        if char == "\\":
            name = self._peek_command()
            return name is not None and name not in _MUL_COMMANDS and name != "%"
        return self.text.startswith("pi", self.pos)

    def signed(self) -> float:
        char = self._peek()
        if char in ("+", "-"):
            self.pos += 1
            self._enter()
            value = self.signed()
            self.depth -= 1
            return -value if char == "-" else value
        return self.power()

    def power(self) -> float:
        base = self.postfix()
        if self._peek() != "^":
            return base
        self.pos += 1
        self._enter()
        exponent = self.signed()
        self.depth -= 1
        return _power(base, exponent)

    def postfix(self) -> float:
        value = self.atom()
        while True:
            if self._peek() == "%":
                self.pos += 1
            elif self._peek_command() == "%":
                self._take_command()
            else:
                return value
            value /= 100.0

    def atom(self) -> float:
        char = self._peek()
        if _is_digit(char) or char == ".":
            return self._number()
        if char in _CLOSERS:
            self.pos += 1
            value = self.expr()
            self._expect(_CLOSERS[char])
            return value
        if char == "π":
            self.pos += 1
            return math.pi
        if char == "√":
            self.pos += 1
            # Plain-text √ takes a whole number (√12), unlike \sqrt12 which takes one digit.
            radicand = self._number() if _is_digit(self._peek()) else self._argument()
            return _root(radicand, 2)
        if char == "\\":
            return self._command_atom()
        if self.text.startswith("pi", self.pos):
            self.pos += 2
            return math.pi
        raise MathParseError(f"unexpected {char or 'end of text'!r} at position {self.pos}")

    def _number(self) -> float:
        match = _NUMBER.match(self.text, self.pos)
        if match is None:
            raise MathParseError(f"malformed number at position {self.pos}")
        self.pos = match.end()
        return _bounded(float(match.group(0)))

    def _command_atom(self) -> float:
        start = self.pos
        name = self._take_command()
        if name == "pi":
            return math.pi
        if name in _FRAC_NAMES:
            numerator = self._argument()
            denominator = self._argument()
            if denominator == 0:
                raise MathParseError("\\frac with a zero denominator")
            return _bounded(numerator / denominator)
        if name == "sqrt":
            degree = 2.0
            if self._peek() == "[":
                self.pos += 1
                degree = self.expr()
                self._expect("]")
            return _root(self._argument(), degree)
        raise MathParseError(f"unsupported command \\{name} at position {start}")

    def _argument(self) -> float:
        """A LaTeX argument: a {group}, a single digit (\\frac12), or one command atom (\\pi)."""
        char = self._peek()
        if char == "{":
            self.pos += 1
            value = self.expr()
            self._expect("}")
            return value
        if _is_digit(char):
            self.pos += 1
            return float(char)
        if char == "\\":  # \sqrt\pi, \frac\pi2: counted as nesting, they recurse
            self._enter()
            value = self._command_atom()
            self.depth -= 1
            return value
        if char == "(":  # √(3) in plain text
            return self.atom()
        raise MathParseError(f"expected an argument at position {self.pos}")


def evaluate_normalized(expression: str, *, deadline: float | None = None) -> float:
    """Value of an already normalized expression; raises `MathParseError` / `MathLimitError`."""
    if len(expression) > MAX_EXPR_CHARS:
        raise MathTooLong(f"expression has {len(expression)} characters (limit {MAX_EXPR_CHARS})")
    if not expression.strip():
        raise MathParseError("empty expression")
    return _Parser(expression, deadline).parse()


def evaluate(text: str, *, deadline: float | None = None) -> float:
    """Normalize an answer (see `normalize_answer`) and compute its value as a float.

    Raises `MathParseError` for text outside the supported subset, `MathLimitError` when a bound
    is exceeded and `MathTimeout` when `deadline` (a `time.monotonic()` value) passes.
    """
    return evaluate_normalized(normalize_answer(text), deadline=deadline)


# ---------------------------------------------------------------------------------------------
# comparison


def numbers_match(pred: float, gold: float, *, gold_decimals: int | None = None) -> bool:
    """Numeric equality: within `REL_TOL` relative (or `ABS_TOL` absolute) difference, or —
    when the gold answer was written as a rounded decimal with `gold_decimals` >= 1 places —
    when `pred` rounds to it, i.e. |pred - gold| <= 0.5 * 10**-gold_decimals.

    So gold "25.1" accepts 25.13 and 25.05 but rejects 25.16; gold "25" (no decimals written)
    gets only the relative tolerance.
    """
    if math.isclose(pred, gold, rel_tol=REL_TOL, abs_tol=ABS_TOL):
        return True
    if gold_decimals:
        half_unit = 0.5 * 10.0 ** (-gold_decimals)
        # The tiny slack absorbs binary rounding of the decimal literals themselves.
        return abs(pred - gold) <= half_unit * (1 + 1e-9) + 1e-12 * abs(gold)
    return False


def _values(text: str, deadline: float | None) -> list[float]:
    """The value of `text`; for "50%" both 0.5 and 50, since answers mix the two readings."""
    normalized = normalize_answer(text)
    values = [evaluate_normalized(normalized, deadline=deadline)]
    if normalized.endswith("%"):
        values.append(evaluate_normalized(normalized[:-1], deadline=deadline))
    return values


def answers_equivalent(pred: str, gold: str, *, deadline: float | None = None) -> bool:
    """Whether a predicted answer equals the gold one, as strings or as numbers.

    Equal loose strings (`normalize_text`) or equal normalized forms count at once. Otherwise
    both sides are evaluated and compared with `numbers_match` (gold's written decimal places
    enable the rounding rule). Returns False when the gold answer is not numeric and the strings
    differ; raises `MathParseError` when the gold answer is numeric but `pred` cannot be read,
    and `MathLimitError` / `MathTimeout` when a bound is hit on either side.
    """
    if normalize_text(pred) == normalize_text(gold):
        return True
    pred_norm, gold_norm = normalize_answer(pred), normalize_answer(gold)
    if pred_norm.replace(" ", "") == gold_norm.replace(" ", "") and pred_norm:
        return True
    try:
        gold_values = _values(gold, deadline)
    except MathLimitError:
        raise
    except MathParseError:
        return False
    pred_values = _values(pred, deadline)
    places = decimal_places(gold)
    return any(numbers_match(p, g, gold_decimals=places) for p in pred_values for g in gold_values)
