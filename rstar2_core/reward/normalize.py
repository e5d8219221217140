"""A small answer normaliser, OR-ed with `math-verify` by the grader (RECIPE.md: the reference code ORs
math-verify with a sympy-based normaliser).

    normalize_answer("1,000") == normalize_answer("+1000.0") == Fraction(1000)
    normalize_answer("\\\\dfrac{3}{4}") == normalize_answer("0.75") == Fraction(3, 4)

Numbers become exact `Fraction`s once LaTeX wrappers are removed; anything else compares as text with
all whitespace removed. Invariant: pure string work, no sympy: it cannot hang (symbolic equivalence is
math-verify's job, under the pool's timeout). The forms it knows: docs/chat-and-grading.md, "Grading".
"""

from __future__ import annotations

import re
from fractions import Fraction

_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|boxed|mbox)\s*\{([^{}]*)\}")
_DROP = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", "~", r"\displaystyle"]
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_INT = re.compile(r"[+-]?\d+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:(?:,|\{,\}| )\d{3})+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_FRAC = re.compile(r"([+-]?)\\frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}")
_FRAC_SHORT = re.compile(r"([+-]?)\\frac(\d)(\d)")
_SLASH = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")
_MAX_DIGITS = 4000  # Python refuses int() of longer digit strings; compare those as text


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    for a, b in (("$", "$"), (r"\(", r"\)"), (r"\[", r"\]")):
        while len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):len(s) - len(b)].strip()
    prev = None
    while prev != s:
        prev = s
        s = _WRAPPERS.sub(r"\1", s)
    for tok in _DROP:
        s = s.replace(tok, " " if tok == r"\ " else "")
    s = _DEGREES.sub("", s)
    s = s.replace(r"\%", "").replace("%", "").replace("$", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    return s.strip().rstrip(".").strip()


def _number(s: str) -> Fraction | None:
    if _THOUSANDS.fullmatch(s):
        s = re.sub(r",|\{,\}| ", "", s)
    if _INT.fullmatch(s) or _DECIMAL.fullmatch(s):
        if len(s) > _MAX_DIGITS:
            return None
        return Fraction(s)
    for rx in (_FRAC, _FRAC_SHORT):
        m = rx.fullmatch(s)
        if m and len(s) <= _MAX_DIGITS and int(m.group(3)) != 0:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) == "-" else value
    m = _SLASH.fullmatch(s)
    if m and len(s) <= _MAX_DIGITS and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def normalize_answer(answer: str) -> Fraction | str:
    """An exact number when `answer` spells one, else the cleaned text without whitespace."""
    s = _strip_wrappers(answer)
    value = _number(s)
    if value is not None:
        return value
    return re.sub(r"\s+", "", s)


def normalized_equal(pred: str, gold: str) -> bool:
    """Equal after normalisation (numbers by value, other text exactly); an empty answer never matches."""
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == "" or b == "":
        return False
    return type(a) is type(b) and a == b
