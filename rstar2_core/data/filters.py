"""Curation filters. Each takes candidates in order and returns `(kept, dropped)` where `dropped` is a
`Counter` of reasons: `integer_answers`, `exact_duplicates`, `near_duplicates` (MinHash/LSH proposes
candidates, the exact Jaccard of the shingle sets decides), `decontaminate` (a shared word n-gram with
any evaluation benchmark; exact normalised text for the benchmarks in `exact_only`).

Invariant: the order of the input decides which copy of a duplicate survives (the first), and
near-duplicate removal never drops a pair below the threshold. See docs/data-and-eval.md, "Curating
problems".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace

from rstar2_core.data.normalize import integer_answer, ngrams, problem_key, words
from rstar2_core.data.sources import Candidate
from rstar2_core.progress import progress_bar

SHINGLE_WORDS = 5
CANDIDATE_SLACK = 0.15  # LSH proposes pairs from this much below the threshold; exact Jaccard decides


def integer_answers(cands: Sequence[Candidate], max_digits: int) -> tuple[list[Candidate], Counter]:
    kept, dropped = [], Counter()
    for c in cands:
        value, reason = integer_answer(c.answer, max_digits)
        if value is None:
            dropped[reason] += 1
        else:
            kept.append(replace(c, answer=value))
    return kept, dropped


def exact_duplicates(cands: Sequence[Candidate]) -> tuple[list[Candidate], Counter]:
    seen: set[str] = set()
    kept, dropped = [], Counter()
    for c in cands:
        key = problem_key(c.problem)
        if key in seen:
            dropped["duplicate_exact"] += 1
            continue
        seen.add(key)
        kept.append(c)
    return kept, dropped


def shingles(text: str) -> set[str]:
    """Word 5-shingles of the normalised text (the whole text when shorter)."""
    return {" ".join(g) for g in ngrams(words(text), SHINGLE_WORDS)} or {""}


def minhash(sh: set[str], num_perm: int):
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=1)
    m.update_batch([s.encode("utf-8") for s in sorted(sh)])
    return m


def near_duplicates(cands: Sequence[Candidate], threshold: float, num_perm: int,
                    progress: bool = False) -> tuple[list[Candidate], Counter]:
    """Keep a problem unless an earlier kept one has exact Jaccard >= threshold over word 5-shingles.
    LSH (tuned to `threshold - CANDIDATE_SLACK`) proposes candidates; the exact Jaccard of the shingle
    sets decides, so MinHash estimation error never drops a problem below the threshold and rarely
    misses one above it."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=max(0.05, threshold - CANDIDATE_SLACK), num_perm=num_perm)
    kept_sh: dict[str, set[str]] = {}
    kept, dropped = [], Counter()
    for i, c in enumerate(progress_bar(cands, desc="near-duplicates", unit="problem", disable=not progress)):
        sh = shingles(c.problem)
        m = minhash(sh, num_perm)
        if any(len(sh & kept_sh[k]) >= threshold * len(sh | kept_sh[k]) for k in lsh.query(m)):
            dropped["duplicate_near"] += 1
            continue
        key = str(i)
        lsh.insert(key, m)
        kept_sh[key] = sh
        kept.append(c)
    return kept, dropped


def decontaminate(cands: Sequence[Candidate], benchmarks: dict[str, Iterable[str]], n: int,
                  exact_only: Iterable[str] = ()) -> tuple[list[Candidate], Counter]:
    """Drop candidates sharing a word n-gram (or, for `exact_only` benchmarks, the whole normalised
    text) with a benchmark problem. Reason: `contaminated:<benchmark>`."""
    exact_only = set(exact_only)
    grams: dict[tuple[str, ...], str] = {}
    exact: dict[str, str] = {}
    for name, texts in benchmarks.items():
        for t in texts:
            if name in exact_only:
                exact.setdefault(problem_key(t), name)
            else:
                for g in ngrams(words(t), n):
                    grams.setdefault(g, name)
    kept, dropped = [], Counter()
    for c in cands:
        hit = exact.get(problem_key(c.problem))
        if hit is None:
            hit = next((grams[g] for g in ngrams(words(c.problem), n) if g in grams), None)
        if hit is not None:
            dropped[f"contaminated:{hit}"] += 1
        else:
            kept.append(c)
    return kept, dropped


def unique_ids(cands: Sequence[Candidate]) -> tuple[list[Candidate], Counter]:
    seen: set[str] = set()
    kept, dropped = [], Counter()
    for c in cands:
        if c.id in seen:
            dropped["duplicate_id"] += 1
            continue
        seen.add(c.id)
        kept.append(c)
    return kept, dropped
