"""Sampling-based label check (the paper: sample a strong model 16 times per problem and keep the
problem only if at least 2 answers agree with its label).

`label_check(cands, sampler, grade, k, min_agree, limits, seed)` samples `k` trajectories per problem
with a `PolicySampler` (the real agent loop, tools included), grades each final answer against the
label with `grade` (a `GraderPool.grade_many`), and returns the kept candidates, the drop counter and
the agreeing samples per candidate id. Invariant: a problem is kept only with at least `min_agree`
correct samples (else `label_disagree`); beyond `max_problems` a seeded sample is checked and the rest
dropped as `label_unchecked`. See docs/data-and-eval.md, "Curating problems" (label_check).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rstar2_core.data.sources import Candidate
from rstar2_core.progress import progress_bar

GradeFn = Callable[[list[tuple[str, str]]], list[Any]]


def label_check(cands: Sequence[Candidate], sampler: Any, grade: GradeFn, *, k: int, min_agree: int,
                limits: Any, seed: int, batch_size: int = 64, progress: bool = True,
                max_problems: int | None = None) -> tuple[list[Candidate], Counter, dict[str, int]]:
    if min_agree > k:
        raise ValueError(f"data.label_check.min_agree={min_agree} exceeds k={k}: no problem could pass; "
                         "lower min_agree or raise k")
    kept, dropped, agree = [], Counter(), {}
    if max_problems is not None and len(cands) > max_problems:    # the budget: a seeded sample, in order
        chosen = set(random.Random(seed).sample(range(len(cands)), max_problems))
        dropped["label_unchecked"] = len(cands) - max_problems
        cands = [c for i, c in enumerate(cands) if i in chosen]
    bar = progress_bar(total=len(cands), desc="label check", unit="problem", disable=not progress)
    for start in range(0, len(cands), batch_size):
        batch = list(cands[start:start + batch_size])
        groups = sampler.sample([c.problem for c in batch], k, limits, seed + start)
        items = [(t.response_text, c.answer) for c, g in zip(batch, groups) for t in g]
        results = grade(items)
        pos = 0
        for c, g in zip(batch, groups):
            n_ok = sum(r.reward >= 1.0 for r in results[pos:pos + len(g)])
            pos += len(g)
            agree[c.id] = n_ok
            if n_ok >= min_agree:
                kept.append(c)
            else:
                dropped["label_disagree"] += 1
        bar.update(len(batch))
    bar.close()
    return kept, dropped, agree
