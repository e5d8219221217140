"""Answer and problem-text normalisation shared by the curation filters and decontamination.

- `integer_answer(raw, max_digits)` turns a label into an integer string or a rejection reason:
  `1,000` -> `1000`, `\\frac{4}{2}` -> `2`, `\\boxed{12}` -> `12`, `$-7$` -> `-7`, `12.0` -> `12`;
  `1.5`, `\\sqrt{2}`, `x+1`, `\\frac{1}{3}` are rejected (`answer_not_integer`), labels with more than
  `max_digits` digits are rejected (`answer_too_many_digits`) before any big-integer arithmetic.
- `problem_key(text)` is the exact-duplicate key (lower-cased, punctuation and whitespace folded).
- `words(text)` is the word sequence used by MinHash shingles and n-gram decontamination.

Invariant: a small literal parser, not a CAS: an answer that needs evaluating (`2^{10}`, `10!`) is
rejected rather than guessed. See docs/data-and-eval.md, "Curating problems".
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

REASON_NOT_INTEGER = "answer_not_integer"
REASON_TOO_MANY_DIGITS = "answer_too_many_digits"
REASON_EMPTY = "answer_empty"

_WRAPPERS = (r"\boxed", r"\fbox", r"\text", r"\textbf", r"\mathrm", r"\mathbf", r"\displaystyle")
_INT_RE = re.compile(r"[+-]?\d+")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(,\d{3})+")
_DECIMAL_RE = re.compile(r"([+-]?\d+)\.(\d+)")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_SLASH_RE = re.compile(r"([+-]?\d+)/(\d+)")


def _unwrap(s: str) -> str:
    """Strip `$...$`, `\\(...\\)`, `\\boxed{...}`, `\\text{...}` and surrounding braces, repeatedly."""
    prev = None
    while prev != s:
        prev = s
        s = s.strip()
        for a, b in (("$$", "$$"), ("$", "$"), (r"\(", r"\)"), (r"\[", r"\]")):
            if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
                s = s[len(a):len(s) - len(b)]
        for w in _WRAPPERS:
            if s.startswith(w + "{") and s.endswith("}") and _balanced(s[len(w) + 1:-1]):
                s = s[len(w) + 1:-1]
        if s.startswith("{") and s.endswith("}") and _balanced(s[1:-1]):
            s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


def _digits(s: str) -> int:
    return len(s.lstrip("+-").lstrip("0")) or 1


def integer_answer(raw: object, max_digits: int) -> tuple[str | None, str | None]:
    """(canonical integer string, None) or (None, reason). `raw` may be a str or an int."""
    if isinstance(raw, bool) or raw is None:
        return None, REASON_NOT_INTEGER if raw is not None else REASON_EMPTY
    if isinstance(raw, int):
        raw = str(raw)
    elif isinstance(raw, float):
        if not raw.is_integer():
            return None, REASON_NOT_INTEGER
        raw = str(int(raw))
    if not isinstance(raw, str):
        return None, REASON_NOT_INTEGER
    s = _unwrap(raw)
    for junk in (r"\!", r"\,", r"\;", r"\ ", "~", " ", "\u00a0", "\u2009"):
        s = s.replace(junk, "")
    s = s.replace("{,}", ",").replace("\u2212", "-")
    s = _unwrap(s)
    if not s:
        return None, REASON_EMPTY
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _INT_RE.fullmatch(s):
        return _canon(s, max_digits)
    m = _DECIMAL_RE.fullmatch(s)
    if m:
        if set(m.group(2)) != {"0"}:
            return None, REASON_NOT_INTEGER
        return _canon(m.group(1), max_digits)
    m = _FRAC_RE.fullmatch(s.lstrip("-")) or _SLASH_RE.fullmatch(s.lstrip("-"))
    if m:
        neg = s.startswith("-")
        num, den = _unwrap(m.group(1)), _unwrap(m.group(2))
        if not (_INT_RE.fullmatch(num) and den.isdigit()):
            return None, REASON_NOT_INTEGER
        if _digits(num) > max_digits + len(den):
            return None, REASON_TOO_MANY_DIGITS
        n, d = int(num), int(den)
        if d == 0 or n % d:
            return None, REASON_NOT_INTEGER
        return _canon(str(-(n // d) if neg else n // d), max_digits)
    return None, REASON_NOT_INTEGER


def _canon(s: str, max_digits: int) -> tuple[str | None, str | None]:
    if _digits(s) > max_digits:
        return None, REASON_TOO_MANY_DIGITS
    return str(int(s)), None


_PUNCT_RE = re.compile(r"[^\w\s]+", re.UNICODE)
_WS_RE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """NFKC, lower case, punctuation to spaces, whitespace collapsed."""
    t = unicodedata.normalize("NFKC", text).lower()
    t = _PUNCT_RE.sub(" ", t)
    return _WS_RE.sub(" ", t).strip()


def words(text: str) -> list[str]:
    return normalize_text(text).split()


def problem_key(text: str) -> str:
    """Exact-duplicate key: sha256 of the normalised text (hex)."""
    return hashlib.sha256(normalize_text(text).encode("utf-8")).hexdigest()


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    """Word n-grams; a text shorter than n yields itself as one gram (so short problems still match)."""
    if not tokens:
        return set()
    if len(tokens) < n:
        return {tuple(tokens)}
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}
