"""Benchmark of the curation filters: MinHash/LSH near-duplicate removal against the exact pairwise
baseline, and 8-gram decontamination, side by side in one run.

Run:  python bench/curation.py [--quick] [--json] [--n N]

A deterministic workload (seed 0) with planted near-duplicates, exact duplicates and contaminations;
recall and precision of ours are measured against the exact pairwise Jaccard on the same data and
threshold (0.85, word 5-shingles). See docs/benchmarks.md, "bench/curation.py".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rstar2_core.data import filters
from rstar2_core.data.normalize import ngrams, words
from rstar2_core.data.sources import Candidate

NOUNS = ["triangle", "circle", "square", "polygon", "sequence", "integer", "prime", "divisor", "function", "matrix", "vector", "graph", "tree", "coin", "die", "card", "ball", "box", "urn", "train", "car", "cyclist", "tank", "pipe", "clock"]
VERBS = ["find", "compute", "determine", "evaluate", "count", "show", "estimate", "express"]
ADJ = ["positive", "negative", "odd", "even", "distinct", "consecutive", "smallest", "largest", "regular", "unit"]
BENCH_SPAN = "the number of ordered pairs of distinct positive integers"


def make_problem(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randrange(3, 6)):
        parts.append(f"{rng.choice(VERBS)} the {rng.choice(ADJ)} {rng.choice(NOUNS)} with {rng.randrange(2, 999)} "
                     f"{rng.choice(ADJ)} {rng.choice(NOUNS)}s and {rng.randrange(2, 99)} {rng.choice(NOUNS)}s")
    return (". ".join(parts) + ".").capitalize()


def workload(n: int, seed: int = 0) -> tuple[list[Candidate], dict[str, list[str]], int]:
    rng = random.Random(seed)
    bench = {"bench": [make_problem(rng) + f" Find {BENCH_SPAN} {i}." for i in range(30)]}
    texts: list[str] = []
    planted_contam = 0
    for i in range(n):
        u = rng.random()
        if texts and u < 0.10:
            base = rng.choice(texts).split(" ")
            if rng.random() < 0.5:
                j = len(base) - 1 - rng.randrange(5)
                base[j] = rng.choice(NOUNS)
                texts.append(" ".join(base))
            else:
                texts.append(" ".join(base) + " Justify briefly.")
        elif texts and u < 0.15:
            texts.append(rng.choice(texts).upper().replace(".", " !"))
        elif u < 0.16:
            texts.append(make_problem(rng) + f" Count {BENCH_SPAN} below {rng.randrange(10, 99)}.")
            planted_contam += 1
        else:
            texts.append(make_problem(rng))
    return [Candidate(f"b/{i}", t, "1", "bench") for i, t in enumerate(texts)], bench, planted_contam


def exact_near_dups(cands: list[Candidate], threshold: float) -> set[str]:
    kept: list[tuple[str, set]] = []
    dropped = set()
    for c in cands:
        sh = {" ".join(g) for g in ngrams(words(c.problem), filters.SHINGLE_WORDS)}
        if any(len(sh & k) / len(sh | k) >= threshold for _, k in kept):
            dropped.add(c.id)
        else:
            kept.append((c.id, sh))
    return dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 1,500 instead of 6,000")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--n", type=int, default=None)
    args = ap.parse_args()
    n = args.n or (1500 if args.quick else 6000)
    cands, bench, planted = workload(n)
    cands, _ = filters.exact_duplicates(cands)   # both contenders see the same exact-deduplicated input
    filters.near_duplicates(cands[:50], 0.85, 128)  # import datasketch/scipy outside the timing

    t = time.perf_counter()
    kept, _dropped = filters.near_duplicates(cands, 0.85, 128)
    ours_s = time.perf_counter() - t
    kept_ids = {c.id for c in kept}
    ours = {c.id for c in cands} - kept_ids
    t = time.perf_counter()
    exact = exact_near_dups(cands, 0.85)
    exact_s = time.perf_counter() - t
    recall = len(ours & exact) / len(exact) if exact else 1.0
    precision = len(ours & exact) / len(ours) if ours else 1.0

    t = time.perf_counter()
    _, contam = filters.decontaminate(kept, bench, 8)
    dec_s = time.perf_counter() - t
    result = {
        "n": len(cands),
        "near_dup": {"ours": {"problems_per_s": round(len(cands) / ours_s, 1), "dropped": len(ours),
                              "wall_s": round(ours_s, 3)},
                     "exact": {"problems_per_s": round(len(cands) / exact_s, 1), "dropped": len(exact),
                               "wall_s": round(exact_s, 3)},
                     "recall": round(recall, 4), "precision": round(precision, 4),
                     "speedup": round(exact_s / ours_s, 2)},
        "decontam": {"problems_per_s": round(len(kept) / dec_s, 1), "found": sum(contam.values()),
                     "planted": planted},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
    }
    nd = result["near_dup"]
    print(f"near-duplicates over {len(cands)} problems (threshold 0.85, word 5-shingles):")
    print(f"  ours  (MinHash/LSH) {nd['ours']['problems_per_s']:>10} problems/s  dropped {nd['ours']['dropped']}")
    print(f"  exact (pairwise)    {nd['exact']['problems_per_s']:>10} problems/s  dropped {nd['exact']['dropped']}")
    print(f"  speedup x{nd['speedup']}  recall {nd['recall']}  precision {nd['precision']}")
    d = result["decontam"]
    print(f"8-gram decontamination: {d['problems_per_s']} problems/s, found {d['found']} (planted {d['planted']}, "
          "some planted ones may have been removed as duplicates first)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
