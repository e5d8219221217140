"""Benchmark of the answer grader: `GraderPool` against the usual alternatives, side by side in one run.

Run:  python bench/grading.py [--quick] [--json] [--workers N] [--timeout-s T]

Workloads `clean` (integers, fractions, symbolic answers, no box) and `hang` (the same with 2% of items
that sympy takes minutes over); contenders ours (worker processes, a hard per-item timeout), in-process
`grade_response`, and a `ProcessPoolExecutor` whose timeout stops the wait but not the work. Invariant:
every item is answered (`agree_share` against the in-process reward). See docs/benchmarks.md,
"bench/grading.py".
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rstar2_core.reward import GraderPool, grade_response

HANG = (r"<answer>\boxed{(10^{8})!}</answer>", "5")


def make_items(n: int, hang_share: float, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        u = rng.random()
        if u < hang_share:
            items.append(HANG)
        elif u < 0.60:
            v = rng.randrange(1, 10**6)
            shown = f"{v:,}" if i % 3 == 0 else str(v)
            items.append((f"<reason>...</reason><answer>The answer is \\boxed{{{shown}}}.</answer>",
                          str(v if i % 2 else v + 1)))
        elif u < 0.75:
            a, b = rng.randrange(1, 20), rng.choice([2, 4, 5, 8])
            items.append((f"<answer>\\boxed{{\\dfrac{{{a}}}{{{b}}}}}</answer>", str(a / b)))
        elif u < 0.90:
            k = rng.randrange(1, 9)
            items.append((f"<answer>\\boxed{{x^2+{2 * k}x+{k * k}}}</answer>", f"(x+{k})^2"))
        else:
            items.append(("I could not finish.", "7"))
    return items


def run_ours(items, workers, timeout_s, repeats=1):
    with GraderPool(workers=workers, timeout_s=timeout_s) as pool:
        pool.grade_many(items[:workers])  # waits for the workers to be ready
        wall = float("inf")
        for _ in range(repeats):  # best of `repeats`: the machine is shared
            t0 = time.perf_counter()
            res = pool.grade_many(items)
            wall = min(wall, time.perf_counter() - t0)
        timeouts = pool.timeouts
    return [(r.reward, r.reason) for r in res], wall, timeouts


def run_in_process(items, repeats=1):
    grade_response(r"\boxed{x^2+1}", "1+x^2")  # warm-up: math-verify and sympy imports
    wall = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = [grade_response(r, g) for r, g in items]
        wall = min(wall, time.perf_counter() - t0)
    return [(x.reward, x.reason) for x in res], wall


def _naive_once(ex, items, timeout_s, budget_s):
    t0 = time.perf_counter()
    futs = [ex.submit(grade_response, r, g) for r, g in items]
    out = []
    for f in futs:
        left = budget_s - (time.perf_counter() - t0)
        if left <= 0:
            out.append((0.0, "lost"))
            continue
        try:
            x = f.result(timeout=min(timeout_s, left))
            out.append((x.reward, x.reason))
        except cf.TimeoutError:
            out.append((0.0, "grader_timeout"))
    return out, time.perf_counter() - t0


def run_naive(items, workers, timeout_s, budget_s, repeats=1):
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    try:
        warm = [(r"\boxed{x^2+1}", "1+x^2")] * (workers * 2)
        list(ex.map(grade_response, [r for r, _ in warm], [g for _, g in warm]))
        wall = float("inf")
        for _ in range(repeats):
            out, w = _naive_once(ex, items, timeout_s, budget_s)
            wall = min(wall, w)
    finally:
        procs = list(getattr(ex, "_processes", {}).values())  # hung workers never stop by themselves
        ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.kill()
            p.join(5)
    return out, wall


def run_clean_interleaved(items, workers, timeout_s, rounds):
    """The three contenders take turns, `rounds` times, and each keeps its best pass: on a shared
    machine the load drifts over minutes, so passes far apart in time are not comparable."""
    walls = {"in_process": [], "ours": [], "naive_pool": []}
    res = {}
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    try:
        warm = [(r"\boxed{x^2+1}", "1+x^2")] * (workers * 2)
        list(ex.map(grade_response, [r for r, _ in warm], [g for _, g in warm]))
        grade_response(*warm[0])
        with GraderPool(workers=workers, timeout_s=timeout_s) as pool:
            pool.grade_many(warm)
            for _ in range(rounds):
                t0 = time.perf_counter()
                res["in_process"] = [(x.reward, x.reason) for x in (grade_response(r, g) for r, g in items)]
                walls["in_process"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                res["ours"] = [(x.reward, x.reason) for x in pool.grade_many(items)]
                walls["ours"].append(time.perf_counter() - t0)
                res["naive_pool"], w = _naive_once(ex, items, timeout_s, budget_s=600.0)
                walls["naive_pool"].append(w)
    finally:
        ex.shutdown()
    ref = res["in_process"]
    return {name: {**summarize(res[name], min(walls[name]), None if name == "in_process" else ref),
                   "passes_s": [round(w, 3) for w in walls[name]]} for name in walls}


def summarize(res, wall, reference=None):
    n = len(res)
    d = {"items": n, "wall_s": round(wall, 3), "items_per_s": round(n / wall, 1) if wall else None,
         "correct_share": round(sum(r for r, _ in res) / n, 4),
         "answered_share": round(sum(reason not in ("grader_timeout", "lost") for _, reason in res) / n, 4)}
    if reference is not None:
        d["agree_share"] = round(sum(a[0] == b[0] for a, b in zip(res, reference)) / n, 4)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer items")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--workers", type=int, default=0, help="grader processes (default: one per core)")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="per-item timeout (default 2)")
    args = ap.parse_args()
    workers = args.workers or os.cpu_count() or 1
    n = 300 if args.quick else 2000
    budget = 15.0 if args.quick else 30.0
    out: dict = {"machine": f"{platform.node()} {os.cpu_count()} cpus", "workers": workers,
                 "timeout_s": args.timeout_s, "quick": args.quick}

    clean = make_items(n, 0.0)
    out["clean"] = run_clean_interleaved(clean, workers, args.timeout_s, rounds=3)

    hang = make_items(n // 2, 0.02, seed=1)
    href = [(0.0, "grader_timeout") if it == HANG else None for it in hang]
    ok_idx = [i for i, it in enumerate(hang) if it != HANG]
    sub_ref, _ = run_in_process([hang[i] for i in ok_idx])
    for i, r in zip(ok_idx, sub_ref):
        href[i] = r
    res, wall, timeouts = run_ours(hang, workers, args.timeout_s)
    out["hang"] = {"n_hang_items": sum(it == HANG for it in hang), "ours": {**summarize(res, wall, href),
                                                                            "timeouts": timeouts}}
    res, wall = run_naive(hang, workers, args.timeout_s, budget_s=budget)
    out["hang"]["naive_pool"] = summarize(res, wall, href)

    c = out["clean"]
    out["ratio_clean_vs_naive"] = round(c["ours"]["items_per_s"] / c["naive_pool"]["items_per_s"], 2)
    out["ratio_clean_vs_in_process"] = round(c["ours"]["items_per_s"] / c["in_process"]["items_per_s"], 2)
    for wl in ("clean", "hang"):
        for name, d in out[wl].items():
            if isinstance(d, dict):
                print(f"{wl:5s} {name:10s} " + "  ".join(f"{k}={v}" for k, v in d.items()))
    print(f"ours/naive_pool items/s on clean: {out['ratio_clean_vs_naive']}x; "
          f"ours/in_process: {out['ratio_clean_vs_in_process']}x")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
