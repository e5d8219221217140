"""Grade one response against a gold answer: reward 1 when the extracted answer matches, else 0.

    grade_response("<answer>\\\\boxed{1,024}</answer>", "1024")
    -> GradeResult(reward=1.0, extracted='1,024', reason='correct')

A match is the normaliser (`normalize.py`) OR `math-verify` (RECIPE.md: the reference code ORs two
graders); no partial credit, no tool-use reward. Invariant: this runs in the calling process with no
timeout (math-verify's `signal.alarm` timeouts only work in a main thread and are switched off), so
anything that grades model output at scale goes through `GraderPool` (`pool.py`).
See docs/chat-and-grading.md, "Grading".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rstar2_core.chat.answer import extract_answer
from rstar2_core.reward.normalize import normalized_equal

REASONS = ("correct", "wrong", "no_answer", "grader_timeout", "grader_error", "invalid_request")
"""`grader_error`: the grader raised or its worker died (reward 0); the others are the contract's."""
GRADER_FAILURES = ("grader_timeout", "grader_error")
"""The reasons for which the grader, not the response, decided the 0: the RL step, the hard subset and
evaluation count them as infrastructure failures."""


@dataclass(frozen=True)
class GradeResult:
    reward: float
    extracted: str | None
    reason: str

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"GradeResult.reason={self.reason!r}; use one of {REASONS}")

    def to_json(self) -> dict:
        return {"reward": int(self.reward), "extracted": self.extracted, "reason": self.reason}


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence "timeout disabled" warnings
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def answers_match(pred: str, gold: str) -> bool:
    """The normaliser OR math-verify (the cheap check first: integer answers never reach the CAS)."""
    if normalized_equal(pred, gold):
        return True
    if not pred.strip() or not gold.strip():
        return False
    return _math_verify_equal(pred, gold)


def grade_response(response_text: str, gold: str) -> GradeResult:
    """Reward of one response (in-process, no timeout: see the module docstring)."""
    extracted = extract_answer(response_text)
    if extracted is None:
        return GradeResult(0.0, None, "no_answer")
    if answers_match(extracted, gold):
        return GradeResult(1.0, extracted, "correct")
    return GradeResult(0.0, extracted, "wrong")
