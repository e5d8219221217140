"""Curate the RL problem set: read sources, filter, publish a versioned parquet dataset + manifest.

    ref = curate(load_config("tiny"), "file:///tmp/datasets")
    # -> <out_url>/<version>/problems.parquet  rows {id, problem, answer, source}
    #    <out_url>/<version>/manifest.json     source digests, counts per filter, config

Invariant: the version is the first 16 hex digits of the content digest, so the same inputs and config
give the same version and URL; both files are written atomically, the manifest last (a version folder
without one is incomplete). See docs/data-and-eval.md, "Curating problems".
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.data import filters
from rstar2_core.data.sources import Candidate, SourceRead, read_source
from rstar2_core.results import DatasetRef

LogMetrics = Callable[[dict[str, float], int], None]
COLUMNS = ("id", "problem", "answer", "source")
STEPS = ("malformed", "answer", "ids", "exact_dedup", "near_dedup", "decontamination", "label_check")


def synthetic_source(cfg: Config) -> SourceRead:
    """The synthetic task's RL split as a source (`generate_problems(seed, n_rl, "rl")`)."""
    from rstar2_core.data.synthetic import generate_problems

    syn = cfg.data.synthetic
    probs = generate_problems(syn.seed, syn.n_rl, "rl")
    cands = tuple(Candidate(f"synthetic/{p.id}", p.problem, str(p.answer), "synthetic") for p in probs)
    digest = hashlib.sha256(json.dumps({"generator": "synthetic", "seed": syn.seed, "n": syn.n_rl,
                                        "rows": [[c.id, c.problem, c.answer] for c in cands]}).encode()).hexdigest()
    return SourceRead("synthetic", "synthetic://rl", "synthetic", digest, len(cands), cands)


def read_all_sources(cfg: Config) -> list[SourceRead]:
    reads = [read_source(s.url, s.layout, s.name) for s in cfg.data.sources]
    if cfg.data.synthetic.enabled and cfg.data.synthetic.n_rl > 0:
        reads.append(synthetic_source(cfg))
    names = [r.name for r in reads]
    if len(set(names)) != len(names):
        raise ValueError(f"data.sources names must be unique, got {names}: set data.sources[].name")
    if not reads:
        raise ValueError("nothing to curate: add data.sources entries or enable data.synthetic")
    return reads


def benchmark_texts(cfg: Config) -> tuple[dict[str, list[str]], list[str], dict[str, str]]:
    """(benchmark name -> problem texts, names matched exactly, name -> digest) for decontamination."""
    from rstar2_core.data.benchmarks import load_benchmark

    texts, exact, digests = {}, [], {}
    for bc in cfg.eval.benchmarks:
        b = load_benchmark(bc.model_copy(update={"limit": None}), cfg)
        texts[b.name] = [p.problem for p in b.problems]
        digests[b.name] = b.digest
        if b.layout == "synthetic":
            exact.append(b.name)
    return texts, exact, digests


def content_digest(rows: list[dict]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r[c] for c in COLUMNS], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def parquet_bytes(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: pa.array([r[c] for r in rows], type=pa.string()) for c in COLUMNS})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _label_check(cfg: Config, cands: list[Candidate], sampler: Any):
    from rstar2_core.data.label_check import label_check
    from rstar2_core.reward import GraderPool
    from rstar2_core.rollout.types import RolloutLimits

    lc = cfg.data.label_check
    limits = RolloutLimits.from_config(cfg.rollout, lc.max_turns or cfg.eval.max_turns,
                                       lc.max_response_tokens or cfg.eval.max_tokens, cfg.eval.temperature,
                                       cfg.eval.top_p)
    with GraderPool(timeout_s=cfg.eval.grader_timeout_s) as pool:
        return label_check(cands, sampler, pool.grade_many, k=lc.k, min_agree=lc.min_agree,
                           limits=limits, seed=cfg.seed, max_problems=lc.max_problems)


def curate(cfg: Config, out_url: str, log_metrics: LogMetrics | None = None, *,
           sampler: Any | None = None, progress: bool = True) -> DatasetRef:
    """Curate `cfg.data` into `<out_url>/<version>/problems.parquet` (+ manifest.json).
    `sampler` samples the label check's trajectories (`data.label_check.enabled`): the caller opens it,
    e.g. `rstar2_core.eval.sampler.label_check_sampler(cfg)`, so that curation does not load models."""
    t0 = time.time()
    d = cfg.data
    if d.label_check.enabled and sampler is None:
        raise ValueError("data.label_check.enabled needs a sampler of the checking model: open it with "
                         "rstar2_core.eval.sampler.label_check_sampler(cfg) and pass sampler=...")
    bench, exact_only, bench_digests = benchmark_texts(cfg)  # fails early on a missing benchmark file
    reads = read_all_sources(cfg)
    counts: dict[str, Any] = {"read": {r.name: r.n_rows for r in reads}}
    dropped: dict[str, Counter] = {s: Counter() for s in STEPS}
    for r in reads:
        dropped["malformed"].update(r.rejected)
    cands = [c for r in reads for c in r.candidates]
    cands, dropped["answer"] = filters.integer_answers(cands, d.max_answer_digits)
    cands, dropped["ids"] = filters.unique_ids(cands)
    cands, dropped["exact_dedup"] = filters.exact_duplicates(cands)
    cands, dropped["near_dedup"] = filters.near_duplicates(cands, d.near_dup_threshold, d.minhash_num_perm,
                                                           progress=progress)
    cands, dropped["decontamination"] = filters.decontaminate(cands, bench, d.decontam_ngram, exact_only)
    agree: dict[str, int] = {}
    if d.label_check.enabled and cands:
        cands, dropped["label_check"], agree = _label_check(cfg, cands, sampler)
    if not cands:
        raise ValueError(f"curation kept 0 problems (dropped: { {k: dict(v) for k, v in dropped.items() if v} }); "
                         "check the sources' layouts and the filters' settings")

    rows = [{"id": c.id, "problem": c.problem, "answer": c.answer, "source": c.source} for c in cands]
    digest = content_digest(rows)
    version = digest[:16]
    vdir = storage.join(out_url, version)
    data_url, manifest_url = storage.join(vdir, "problems.parquet"), storage.join(vdir, "manifest.json")
    counts.update({s: dict(dropped[s]) for s in STEPS})
    counts["kept"] = len(rows)
    counts["kept_by_source"] = dict(Counter(r["source"] for r in rows))
    manifest = {
        "version": version, "digest": digest, "n_rows": len(rows), "url": data_url, "columns": list(COLUMNS),
        "sources": [{"name": r.name, "url": r.url, "layout": r.layout, "sha256": r.digest, "rows": r.n_rows}
                    for r in reads],
        "benchmarks": bench_digests, "counts": counts,
        "label_agreement": agree,
        "config": {"data": d.model_dump(mode="json"), "eval_benchmarks": [b.model_dump(mode="json")
                                                                         for b in cfg.eval.benchmarks]},
        "created_unix": round(t0, 3), "seconds": round(time.time() - t0, 3),
    }
    storage.write_bytes_atomic(data_url, parquet_bytes(rows))
    storage.write_json_atomic(manifest_url, manifest)
    if log_metrics is not None:
        m = {"data/kept": float(len(rows)), "data/read": float(sum(r.n_rows for r in reads))}
        m.update({f"data/dropped/{s}": float(sum(dropped[s].values())) for s in STEPS})
        log_metrics(m, 0)
    return DatasetRef(url=data_url, digest=digest, n_rows=len(rows), manifest_url=manifest_url, counts=counts)


def read_dataset(url: str) -> list[dict]:
    """Rows of a curated parquet dataset (for RL samplers and tests)."""
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(storage.read_bytes(url))).to_pylist()
