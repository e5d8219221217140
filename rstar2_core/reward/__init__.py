"""Answer grading: `grade_response` in-process, `GraderPool` in worker processes with a hard timeout.

    from rstar2_core.reward import GraderPool, GradeResult, grade_response

See docs/chat-and-grading.md.
"""

from rstar2_core.reward.grade import GRADER_FAILURES, REASONS, GradeResult, answers_match, grade_response
from rstar2_core.reward.normalize import normalize_answer, normalized_equal
from rstar2_core.reward.pool import GraderPool

__all__ = [
           "GRADER_FAILURES",
           "REASONS",
           "GradeResult",
           "GraderPool",
           "answers_match",
           "grade_response",
           "normalize_answer",
           "normalized_equal",
]
