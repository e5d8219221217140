"""Grading of evaluation samples: math answers through the reward grader, multiple choice by letter.

- Math items (`EvalProblem.kind == "math"`) go to `grade_math(items)`, normally
  `rstar2_core.reward.GraderPool.grade_many` (math-verify + fallback in a subprocess pool with a
  hard timeout, RECIPE.md).
- Choice items (GPQA-Diamond) are graded here, in-process (no CAS, nothing to time out): the final
  answer (`chat.extract_answer`: last `\\boxed{}` in the last `<answer>`) must name the gold letter.
  Accepted spellings: `C`, `(C)`, `C)`, `C.`, `\\text{C}`, `\\textbf{(C)}`, `c`, and `C) <choice text>`.

Results carry `reward`, `extracted` and `reason` (`correct`, `wrong`, `no_answer`, plus the grader's own
`grader_timeout` / `invalid_request`), like `reward.GradeResult`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_LETTER_RE = re.compile(r"^\(?([A-Da-d])\)?(?:[.):]|\s|$)")
_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


@dataclass(frozen=True)
class ChoiceGrade:
    reward: float
    extracted: str | None
    reason: str


def choice_letter(answer: str | None) -> str | None:
    """The letter A-D an extracted answer names, or None."""
    if answer is None:
        return None
    s = answer.strip().strip("$").strip()
    prev = None
    while prev != s:
        prev = s
        s = _WRAP_RE.sub(r"\1", s).strip()
    m = _LETTER_RE.match(s)
    return m.group(1).upper() if m else None


def grade_choice(response_text: str, gold_letter: str) -> ChoiceGrade:
    from rstar2_core.chat import extract_answer

    raw = extract_answer(response_text)
    if raw is None:
        return ChoiceGrade(0.0, None, "no_answer")
    letter = choice_letter(raw)
    ok = letter is not None and letter == gold_letter.strip().upper()
    return ChoiceGrade(1.0 if ok else 0.0, letter or raw, "correct" if ok else "wrong")


def grade_all(kinds: Sequence[str], items: Sequence[tuple[str, str]],
              grade_math: Callable[[list[tuple[str, str]]], list[Any]]) -> list[Any]:
    """Grade (response_text, gold) items; `kinds[i]` says how item i is graded. Order is kept."""
    if len(kinds) != len(items):
        raise ValueError(f"{len(kinds)} kinds for {len(items)} items")
    out: list[Any] = [None] * len(items)
    math_idx = [i for i, k in enumerate(kinds) if k == "math"]
    for i, k in enumerate(kinds):
        if k == "choice":
            out[i] = grade_choice(*items[i])
        elif k != "math":
            raise ValueError(f"unknown item kind {k!r}; valid: ['choice', 'math']")
    if math_idx:
        res = grade_math([items[i] for i in math_idx])
        if len(res) != len(math_idx):
            raise RuntimeError(f"grader returned {len(res)} results for {len(math_idx)} items")
        for i, r in zip(math_idx, res):
            out[i] = r
    return out
