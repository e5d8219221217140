"""Benchmark of the Python tool service against the naive baseline, measured side by side in one run.

Run:  python bench/sandbox.py [--quick] [--json] [--workers N]

Workloads (issue 4): A trivial, B `sympy.factorint`, C an adversarial mix (loops, 2 GB allocations,
10 MB prints), each at 1, 64 and 256 calls in flight, for `LocalSandbox` confined (the default), the same
service unconfined (A and B, alternating with ours: the confinement's cost) and `subprocess.run` from a
thread pool. Latency is per call from submission to result, queueing included.
See docs/benchmarks.md, "bench/sandbox.py" (timeouts, keys).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox import ExecutionRequest, LocalSandbox, Status

TRIVIAL = "print(sum(range(1000)))"
SYMPY = "import sympy; print(sympy.factorint(2**64+1))"
LOOP = "while True: pass"
ALLOC = "x = bytearray(2 * 1024**3)"
PRINT = "print('x' * 10_000_000)"
CONCURRENCY = (1, 64, 256)
NAIVE_TIMEOUT_S = 60.0


def workload(name: str, n: int, seed: int = 0) -> list[str]:
    if name == "A":
        return [TRIVIAL] * n
    if name == "B":
        return [SYMPY] * n
    rng = random.Random(seed)   # C: exact shares, shuffled
    k_loop, k_alloc, k_print = round(0.10 * n), round(0.05 * n), round(0.05 * n)
    codes = [LOOP] * k_loop + [ALLOC] * k_alloc + [PRINT] * k_print
    codes += [TRIVIAL] * (n - len(codes))
    rng.shuffle(codes)
    return codes


async def drive(call, codes: list[str], conc: int) -> tuple[dict, collections.Counter]:
    lat, wall, statuses = await _timed(call, codes, conc)
    return _figures([lat], [wall], len(codes), statuses), statuses


async def _timed(call, codes: list[str], conc: int) -> tuple[list[float], float, collections.Counter]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []
    statuses: collections.Counter = collections.Counter()

    async def one(code: str) -> None:
        async with sem:
            t = time.perf_counter()
            status = await call(code)
            lat.append(time.perf_counter() - t)
            statuses[status] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in codes))
    return lat, time.perf_counter() - t0, statuses


def _figures(lats: list[list[float]], walls: list[float], n: int, statuses: collections.Counter) -> dict:
    lat = sorted(x for part in lats for x in part)
    wall = sum(walls)
    return {"calls_per_s": round(n / wall, 2), "ok_per_s": round(statuses["ok"] / wall, 2), "p50_ms": round(1e3 * lat[len(lat) // 2], 2),
            "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2), "n": n, "wall_s": round(wall, 2)}


async def drive_abba(calls: dict, codes: list[str], conc: int) -> dict[str, tuple[dict, collections.Counter]]:
    """Run `codes` through each of the two callers in halves, in the order A B B A."""
    half = [codes[: len(codes) // 2], codes[len(codes) // 2:]]
    names = list(calls)
    parts: dict = {k: ([], [], collections.Counter()) for k in names}
    for name, h in ((names[0], 0), (names[1], 0), (names[1], 1), (names[0], 1)):
        lat, wall, st = await _timed(calls[name], half[h], conc)
        parts[name][0].append(lat)
        parts[name][1].append(wall)
        parts[name][2].update(st)
    return {k: (_figures(lats, walls, len(codes), st), st) for k, (lats, walls, st) in parts.items()}


def service_cpu_s(sb: LocalSandbox) -> float:
    """CPU seconds the service's templates used so far: their own, their finished calls', and their
    helpers' (the reaper). Less sensitive to other jobs on the machine than calls/s."""
    total = 0.0
    for ts in sb._d.templates.values():
        for t in ts:
            p = psutil.Process(t.proc.pid)
            c = p.cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
            for helper in p.children():
                h = helper.cpu_times()
                total += h.user + h.system
    return total


def ours_caller(sb: LocalSandbox):
    async def call(code: str) -> str:
        return (await sb.run(ExecutionRequest(code=code))).status.value
    return call


def naive_caller(pool: concurrent.futures.ThreadPoolExecutor, timeout_s: float, memory_mb: int | None):
    prefix = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_mb << 20}, {memory_mb << 20}))\n"
              if memory_mb else "")

    def blocking(code: str) -> str:
        try:
            p = subprocess.run([sys.executable, "-c", prefix + code], timeout=timeout_s, capture_output=True,
                               check=False)
        except subprocess.TimeoutExpired:
            return "timeout"
        return "ok" if p.returncode == 0 else "error"

    async def call(code: str) -> str:
        return await asyncio.get_running_loop().run_in_executor(pool, blocking, code)
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer calls, 1 s timeout on C")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--workers", type=int, default=0, help="our concurrent calls (0 = the config default)")
    ap.add_argument("--c-timeout-s", type=float, default=None, help="per-call timeout on C for both (default 4, quick 1)")
    args = ap.parse_args()
    timeouts = {"A": 4.0, "B": 4.0, "C": args.c_timeout_s or (1.0 if args.quick else 4.0)}
    scale = 1 if args.quick else 4
    n_ours = {"A": 300 * scale, "B": 60 * scale, "C": 40 * scale}
    n_naive = {"A": 80 * scale, "B": 12 * scale, "C": 40 * scale}
    cfgs = {w: SandboxConfig(workers=args.workers, timeout_s=timeouts[w]) for w in "ABC"}
    out: dict = {"ours": {}, "unconfined": {}, "naive": {}, "statuses": {"ours": {}, "unconfined": {}, "naive": {}}}
    t_start = time.perf_counter()
    total = 3 * 3 * len(CONCURRENCY) - len(CONCURRENCY)
    done = 0

    def progress(who: str, w: str, c: int, fig: dict) -> None:
        nonlocal done
        done += 1
        el = time.perf_counter() - t_start
        eta = el / done * (total - done)
        print(f"[{done:2d}/{total}] {who:10s} {w} c={c:<3d} {fig['calls_per_s']:9.1f} calls/s  p50 {fig['p50_ms']:8.1f} ms"
              f"  p99 {fig['p99_ms']:8.1f} ms  (n={fig['n']}, {el:.0f}s elapsed, ETA {eta:.0f}s)", flush=True)

    with LocalSandbox(cfgs["A"]) as sb, LocalSandbox(cfgs["A"], confine=False) as sb_u, LocalSandbox(cfgs["C"]) as sb_c:
        for box in (sb, sb_u):
            asyncio.run(drive(ours_caller(box), [TRIVIAL] * 20 + [SYMPY] * 4, 2))  # warm-up
        pids = {t.proc.pid for ts in sb_c._d.templates.values() for t in ts}
        for w in "ABC":
            for who in ("ours", "unconfined"):
                out[who][w], out["statuses"][who][w] = {}, {}
            cpu0 = {"ours": service_cpu_s(sb), "unconfined": service_cpu_s(sb_u)}
            for c in CONCURRENCY:
                if w == "C":
                    runs = {"ours": asyncio.run(drive(ours_caller(sb_c), workload(w, n_ours[w]), c))}
                else:
                    runs = asyncio.run(drive_abba({"ours": ours_caller(sb), "unconfined": ours_caller(sb_u)},
                                                  workload(w, n_ours[w]), c))
                for who, (fig, st) in runs.items():
                    out[who][w][str(c)], out["statuses"][who][w][str(c)] = fig, dict(st)
                    progress(who, w, c, fig)
            if w != "C":
                time.sleep(0.5)   # the reaper's last teardowns
                for who, box in (("ours", sb), ("unconfined", sb_u)):
                    out[who][w]["cpu_ms_per_call"] = round(
                        1e3 * (service_cpu_s(box) - cpu0[who]) / (n_ours[w] * len(CONCURRENCY)), 3)
        del out["unconfined"]["C"], out["statuses"]["unconfined"]["C"]
        alive = sb_c.run_sync(ExecutionRequest(code=TRIVIAL)).status is Status.OK
        restarted = pids != {t.proc.pid for ts in sb_c._d.templates.values() for t in ts}
        out["sandbox_stats"] = sb.stats()
        out["workers"] = sb.workers
        out["isolation"] = {k: v["features"] for k, v in sb.features.items()}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for w in "ABC":
            out["naive"][w], out["statuses"]["naive"][w] = {}, {}
            # A and B: a generous timeout, so the baseline's calls complete and its rate is a real one.
            call = naive_caller(pool, timeouts[w] if w == "C" else NAIVE_TIMEOUT_S, cfgs[w].memory_mb if w == "C" else None)
            for c in CONCURRENCY:
                fig, st = asyncio.run(drive(call, workload(w, n_naive[w]), c))
                out["naive"][w][str(c)], out["statuses"]["naive"][w][str(c)] = fig, dict(st)
                progress("naive", w, c, fig)
    for w in "AB":
        out[f"ratio_{w}"] = round(out["ours"][w]["64"]["calls_per_s"] / out["naive"][w]["64"]["calls_per_s"], 2)
        wall = {who: sum(out[who][w][str(c)]["wall_s"] for c in CONCURRENCY) for who in ("ours", "unconfined")}
        out[f"confinement_cost_{w}"] = round(1 - wall["unconfined"] / wall["ours"], 3)
        cpu = {who: out[who][w]["cpu_ms_per_call"] for who in ("ours", "unconfined")}
        out[f"confinement_cpu_cost_{w}"] = round(1 - cpu["unconfined"] / cpu["ours"], 3)
    c_counts = out["statuses"]["ours"]["C"]
    out["C_all_answered"] = all(sum(v.values()) == n_ours["C"] and "internal" not in v for v in c_counts.values())
    out["service_alive"] = alive
    out["template_restarted"] = restarted
    out["machine"] = f"{platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["timeout_s"] = timeouts
    a1, a256 = out["ours"]["A"]["1"], out["ours"]["A"]["256"]
    print(f"\nratio_A {out['ratio_A']} (target >= 5), ratio_B {out['ratio_B']} (target >= 20), "
          f"confinement cost A {out['confinement_cost_A']:.1%} B {out['confinement_cost_B']:.1%} (target <= 10%; "
          f"in CPU per call A {out['confinement_cpu_cost_A']:.1%} B {out['confinement_cpu_cost_B']:.1%}), "
          f"A p50 at c=1 {a1['p50_ms']} ms (target <= 5), A p99 at c=256 {a256['p99_ms']} ms (target <= 500), "
          f"C all answered {out['C_all_answered']}, service alive {alive}; {out['machine']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
