"""Evaluation benchmarks: one loader per public layout (`aime`, `hmmt`, `math500`, `gpqa`, `generic`,
`synthetic`; `BenchmarkConfig.layout`), from any fsspec URL (JSONL or parquet); `detect_layout(columns)`
guesses one for a bare URL given on the command line.

They live with the data sources (same files, same field helpers) so that both evaluation and
curation's decontamination load them without data/ importing eval/. Invariant: a file whose rows lack
the layout's fields raises `SourceLayoutError` naming them; single malformed rows are skipped and
counted in `Benchmark.rejected`. See docs/data-and-eval.md, "Benchmark layouts".
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rstar2_core.config import BenchmarkConfig, Config
from rstar2_core.data.sources import (
    ANSWER,
    ID,
    PROBLEM,
    Reject,
    SourceLayoutError,
    adapt_rows,
    check_layout,
    file_format,
    id_field,
    iter_rows,
    label_field,
    problem_field,
    read_raw,
    text_field,
)

LETTERS = "ABCD"


@dataclass(frozen=True)
class EvalProblem:
    """One benchmark item. `kind` = "math" (graded by the math grader) or "choice" (gold is a letter)."""

    id: str
    problem: str
    answer: str
    kind: str = "math"
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Benchmark:
    name: str
    layout: str
    url: str | None
    digest: str
    problems: tuple[EvalProblem, ...]
    rejected: Counter = field(default_factory=Counter)


def _math(row: dict, i: int) -> EvalProblem:
    return EvalProblem(id_field(row, ID, i), problem_field(row, PROBLEM), label_field(row, ANSWER))


def _math500(row: dict, i: int) -> EvalProblem:
    p = _math(row, i)
    meta = {k: row[k] for k in ("subject", "level") if row.get(k) is not None}
    return EvalProblem(p.id, p.problem, p.answer, "math", meta)


def gpqa_choices(question: str, correct: str, incorrect: list[str], key: str) -> tuple[str, str]:
    """(problem text with lettered choices, gold letter); the shuffle depends only on `key`."""
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big"))
    options = [correct.strip(), *(x.strip() for x in incorrect)]
    order = list(range(4))
    rng.shuffle(order)
    lines = [f"{LETTERS[j]}) {options[o]}" for j, o in enumerate(order)]
    text = (f"{question.strip()}\n\n" + "\n".join(lines)
            + "\n\nAnswer with the letter (A, B, C or D) of the correct choice.")
    return text, LETTERS[order.index(0)]


def _gpqa(row: dict, i: int) -> EvalProblem:
    q = problem_field(row, ("Question",))
    correct = text_field(row, ("Correct Answer",))
    wrong = [text_field(row, (f"Incorrect Answer {j}",)) for j in (1, 2, 3)]
    if not correct or not correct.strip() or any(not w or not w.strip() for w in wrong):
        raise Reject("empty_choice")
    rid = id_field(row, ("Record ID", "id"), i)
    text, gold = gpqa_choices(q, correct, wrong, rid if "Record ID" in row or "id" in row else q)
    return EvalProblem(rid, text, gold, "choice", {"correct_text": correct.strip()})


LOADERS: dict[str, Callable[[dict, int], EvalProblem]] = {
    "aime": _math, "hmmt": _math, "generic": _math, "math500": _math500, "gpqa": _gpqa,
}
LAYOUT_FIELDS = {
    "aime": "id (or ID), problem (or Problem, question), answer (or Answer)",
    "hmmt": "problem_idx (or id), problem, answer",
    "generic": "problem (or question), answer; optional id",
    "math500": "problem, answer, unique_id; optional subject, level, solution",
    "gpqa": "Question, Correct Answer, Incorrect Answer 1, Incorrect Answer 2, Incorrect Answer 3",
    "synthetic": "(generated; no file)",
}


def detect_layout(columns: set[str]) -> str:
    """Best-guess layout from the field names of a file's rows."""
    if {"Question", "Correct Answer"} <= columns:
        return "gpqa"
    if {"unique_id", "subject"} <= columns:
        return "math500"
    if "problem_idx" in columns:
        return "hmmt"
    return "generic"


def _first_row_keys(url: str, data: bytes) -> set[str]:
    for row in iter_rows(url, data):
        if isinstance(row, dict):
            return set(row)
    return set()


def benchmark_from_url(url: str, name: str | None = None, layout: str | None = None) -> BenchmarkConfig:
    """A BenchmarkConfig for a bare file URL; the layout is detected from its fields when not given."""
    if layout is None:
        file_format(url)
        data, _ = read_raw(url)
        layout = detect_layout(_first_row_keys(url, data))
    stem = url.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    return BenchmarkConfig(name=name or stem, url=url, layout=layout)


def _synthetic(bc: BenchmarkConfig, cfg: Config | None) -> Benchmark:
    from rstar2_core.data.synthetic import generate_problems

    if cfg is None:
        raise ValueError("the synthetic benchmark is generated from data.synthetic: pass the config")
    syn = cfg.data.synthetic
    n = min(syn.n_eval, bc.limit) if bc.limit else syn.n_eval
    probs = tuple(EvalProblem(str(p.id), p.problem, str(p.answer), "math",
                              {"family": getattr(p, "family", None)})
                  for p in generate_problems(syn.seed, n, "eval"))
    digest = hashlib.sha256(json.dumps([[p.id, p.problem, p.answer] for p in probs]).encode()).hexdigest()
    return Benchmark(bc.name, "synthetic", None, digest, probs)


def load_benchmark(bc: BenchmarkConfig, cfg: Config | None = None) -> Benchmark:
    """Load one configured benchmark (first `bc.limit` problems when set)."""
    if bc.layout == "synthetic":
        return _synthetic(bc, cfg)
    if bc.layout not in LOADERS:
        raise ValueError(f"benchmark {bc.name!r}: unknown layout {bc.layout!r}; valid: {sorted(LAYOUT_FIELDS)}")
    if not bc.url:
        raise ValueError(f"benchmark {bc.name!r} (layout {bc.layout}) needs a url: set "
                         f"eval.benchmarks[].url to its JSONL/parquet file")
    file_format(bc.url)
    data, digest = read_raw(bc.url)
    load = LOADERS[bc.layout]
    rows = adapt_rows(bc.url, data, load)
    probs: list[EvalProblem] = []
    rejected = rows.rejected
    seen: set[str] = set()
    for p in rows.items:
        if p.id in seen:
            rejected["duplicate_id"] += 1
            continue
        seen.add(p.id)
        probs.append(p)
    try:
        check_layout(bc.url, bc.layout, rows.n_rows, len(probs), rejected, rows.keys, LAYOUT_FIELDS)
    except SourceLayoutError as e:
        raise SourceLayoutError(f"benchmark {bc.name!r}: {e}") from None
    if bc.limit:
        probs = probs[:bc.limit]
    return Benchmark(bc.name, bc.layout, bc.url, digest, tuple(probs), rejected)


def resolve_benchmarks(cfg: Config, names: list | None = None) -> list[BenchmarkConfig]:
    """Configured benchmarks, or the named ones: a name from eval.benchmarks, a BenchmarkConfig, or a
    file URL/path (layout detected). An unknown name raises listing the configured ones."""
    if not names:
        return list(cfg.eval.benchmarks)
    by_name = {b.name: b for b in cfg.eval.benchmarks}
    out = []
    for n in names:
        if isinstance(n, BenchmarkConfig):
            out.append(n)
        elif n in by_name:
            out.append(by_name[n])
        elif "://" in n or n.endswith((".jsonl", ".json", ".parquet", ".ndjson")):
            out.append(benchmark_from_url(n))
        else:
            raise ValueError(f"unknown benchmark {n!r}: use one of the configured {sorted(by_name)} or a "
                             ".jsonl/.parquet file URL")
    return out
