"""Scripted stand-ins for the policy sampler and the math grader (imported by the eval tests)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rstar2_core.rollout.types import ToolCallRecord, Trajectory


def traj(text: str, n_tokens: int = 10, calls: tuple = (), truncated: bool = False, gen: int | None = None):
    gen = n_tokens if gen is None else gen
    return Trajectory(prompt_ids=(1,), response_ids=tuple(range(n_tokens)),
                      loss_mask=tuple([1] * gen + [0] * (n_tokens - gen)), logprobs=tuple([0.0] * n_tokens),
                      response_text=text, tool_calls=tuple(calls), n_turns=1, n_answer_blocks=1,
                      finish="max_tokens" if truncated else "answer", truncated=truncated)


class ScriptedSampler:
    """Answers each sample correctly with probability `p`, drawn from Random((seed, problem, j)); the
    gold answers come from `gold` (problem text -> answer). Wrong answers are "-1"."""

    def __init__(self, gold: dict[str, str], p: float):
        self.gold, self.p = gold, p
        self.seeds: list[int] = []

    def sample(self, problems, n, limits, seed):
        self.seeds.append(seed)
        out = []
        for pr in problems:
            group = []
            for j in range(n):
                ok = random.Random(f"{seed}|{pr}|{j}").random() < self.p
                ans = self.gold[pr] if ok else "-1"
                calls = (ToolCallRecord("python", "ok", False), ToolCallRecord("python", "error", True))
                group.append(traj(f"<reason>r</reason><answer>\\boxed{{{ans}}}</answer>", 10 + j, calls, j == 0))
            out.append(group)
        return out

    def close(self):
        pass


@dataclass(frozen=True)
class Grade:
    reward: float
    extracted: str | None
    reason: str


def exact_grader(items):
    out = []
    for text, gold in items:
        m = re.findall(r"\\boxed\{([^{}]*)\}", text)
        if not m:
            out.append(Grade(0.0, None, "no_answer"))
        else:
            out.append(Grade(float(m[-1] == gold), m[-1], "correct" if m[-1] == gold else "wrong"))
    return out
