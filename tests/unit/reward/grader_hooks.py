"""Test-only grade functions for GraderPool workers (module-level so spawned workers can import them).

The gold string picks the misbehaviour; anything else is graded normally.
"""

from __future__ import annotations

import os
import time

from rstar2_core.reward import GradeResult, grade_response


def misbehaving_grade(response: str, gold: str) -> GradeResult:
    if gold == "__sleep__":
        time.sleep(3600)
    if gold == "__die__":
        os._exit(3)
    if gold == "__raise__":
        raise ValueError("grader bug")
    if gold == "__memory__":
        b"x" * (64 * 1024**3)  # over the worker's address-space cap: MemoryError
    return grade_response(response, gold)
