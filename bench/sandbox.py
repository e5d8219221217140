"""Benchmark of the Python tool service against the naive baseline, measured side by side in one run.

Run:  python bench/sandbox.py [--quick] [--json] [--workers N]

Workloads (issue 4): A trivial, B `sympy.factorint`, C an adversarial mix (loops, 2 GB allocations,
10 MB prints), each at 1, 64 and 256 calls in flight, for `LocalSandbox` confined (the default), the same
service unconfined (A and B, alternating with ours: the confinement's cost) and `subprocess.run` from a
thread pool; and the tool service (A and B; Ray and Serve up for every arm): `service_handle` (Serve's
in-cluster handle) and `service_http` sending batches as the rollout does, `service_http_single` one call
per HTTP request. Latency is per call from submission to result, queueing included.
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
from rstar2_core.sandbox.service import default_workers

TRIVIAL = "print(sum(range(1000)))"
SYMPY = "import sympy; print(sympy.factorint(2**64+1))"
LOOP = "while True: pass"
ALLOC = "x = bytearray(2 * 1024**3)"
PRINT = "print('x' * 10_000_000)"
CONCURRENCY = (1, 64, 256)
NAIVE_TIMEOUT_S = 60.0
SERVICE_ARMS = ("service_handle", "service_http", "service_http_single")


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


async def drive_batched(run_batch, codes: list[str], conc: int) -> tuple[dict, collections.Counter]:
    """`codes` sent as the rollout sends tool calls: batches (`run_batch`) of `conc` // 2 calls, two in flight
    (so at most `conc` calls: one batch runs while the other travels); a call's latency is its batch's."""
    size = max(1, conc // 2)
    batches = [codes[i:i + size] for i in range(0, len(codes), size)]
    sem = asyncio.Semaphore(max(1, min(2, conc)))
    lat: list[float] = []
    statuses: collections.Counter = collections.Counter()

    async def one(batch: list[str]) -> None:
        async with sem:
            t = time.perf_counter()
            res = await run_batch([ExecutionRequest(code=c) for c in batch])
            dt = time.perf_counter() - t
            lat.extend([dt] * len(res))
            statuses.update(r.status.value for r in res)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    return _figures([lat], [time.perf_counter() - t0], len(codes), statuses), statuses


class ToolServiceArms:
    """The tool service (rstar2_core/runtime/ray/tool_service.py) on a local Ray for the bench: one replica with
    the in-process service's workers, deployed before any arm runs (so every arm shares the 2 cores with
    Ray and Serve), called through the in-cluster handle and over HTTP (batched and one call per request)."""

    def __init__(self, workers: int, timeout_s: float):
        import socket

        from rstar2_core.config import ClusterConfig
        from rstar2_core.runtime.ray.connect import ensure_ray
        from rstar2_core.runtime.ray.tool_service import deploy_tool_service

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self.cfg = SandboxConfig(backend="service", workers=workers, timeout_s=timeout_s,
                                 service={"replicas": 1, "cpus_per_replica": 1, "url": f"http://127.0.0.1:{port}/sandbox",
                                          "max_ongoing_requests": 512, "max_batch": 256})
        ensure_ray(ClusterConfig(cpus_per_node=os.cpu_count() or 2))        # a local Ray of this machine's CPUs
        deploy_tool_service(self.cfg, http_host="127.0.0.1", http_port=port)

    def callers(self) -> dict:
        from rstar2_core.runtime.ray.tool_service import ToolServiceHandle
        from rstar2_core.sandbox.remote import HttpToolService

        return {"service_handle": ToolServiceHandle(self.cfg), "service_http": HttpToolService(self.cfg),
                "service_http_single": HttpToolService(self.cfg)}

    async def run_arm(self, name: str, codes: list[str], conc: int) -> tuple[dict, collections.Counter]:
        async with self.callers()[name] as client:
            if name == "service_http_single":
                async def call(code: str) -> str:
                    return (await client.run_single(ExecutionRequest(code=code))).status.value
                return await drive(call, codes, conc)
            return await drive_batched(client.run_batch, codes, conc)

    def close(self) -> None:
        from rstar2_core.runtime.ray.connect import disconnect_ray
        from rstar2_core.runtime.ray.tool_service import shutdown_tool_services

        shutdown_tool_services()
        disconnect_ray()


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
    ap.add_argument("--no-service", action="store_true", help="skip the tool service's arms (no Ray, no Serve)")
    args = ap.parse_args()
    timeouts = {"A": 4.0, "B": 4.0, "C": args.c_timeout_s or (1.0 if args.quick else 4.0)}
    scale = 1 if args.quick else 4
    n_ours = {"A": 300 * scale, "B": 60 * scale, "C": 40 * scale}
    n_naive = {"A": 80 * scale, "B": 12 * scale, "C": 40 * scale}
    cfgs = {w: SandboxConfig(workers=args.workers, timeout_s=timeouts[w]) for w in "ABC"}
    out: dict = {"ours": {}, "unconfined": {}, "naive": {}, "statuses": {"ours": {}, "unconfined": {}, "naive": {}}}
    arms = () if args.no_service else SERVICE_ARMS
    for a in arms:
        out[a], out["statuses"][a] = {}, {}
    t_start = time.perf_counter()
    total = 3 * 3 * len(CONCURRENCY) - len(CONCURRENCY) + len(arms) * 2 * len(CONCURRENCY)
    done = 0

    def progress(who: str, w: str, c: int, fig: dict) -> None:
        nonlocal done
        done += 1
        el = time.perf_counter() - t_start
        eta = el / done * (total - done)
        print(f"[{done:2d}/{total}] {who:10s} {w} c={c:<3d} {fig['calls_per_s']:9.1f} calls/s  p50 {fig['p50_ms']:8.1f} ms"
              f"  p99 {fig['p99_ms']:8.1f} ms  (n={fig['n']}, {el:.0f}s elapsed, ETA {eta:.0f}s)", flush=True)

    service = ToolServiceArms(args.workers or default_workers(cfgs["A"]), timeouts["A"]) if arms else None
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
            if w != "C" and service is not None:      # the same workload, each arm beside the in-process one
                for a in arms:
                    out[a][w], out["statuses"][a][w] = {}, {}
                    asyncio.run(service.run_arm(a, [TRIVIAL] * 8, 2))        # warm-up: connections, handle
                    for c in CONCURRENCY:
                        fig, st = asyncio.run(service.run_arm(a, workload(w, n_ours[w]), c))
                        out[a][w][str(c)], out["statuses"][a][w][str(c)] = fig, dict(st)
                        progress(a, w, c, fig)
        del out["unconfined"]["C"], out["statuses"]["unconfined"]["C"]
        alive = sb_c.run_sync(ExecutionRequest(code=TRIVIAL)).status is Status.OK
        restarted = pids != {t.proc.pid for ts in sb_c._d.templates.values() for t in ts}
        out["sandbox_stats"] = sb.stats()
        out["workers"] = sb.workers
        out["isolation"] = {k: v["features"] for k, v in sb.features.items()}
    if service is not None:
        service.close()
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
    for a in arms:
        out[f"{a}_share_A64"] = round(out[a]["A"]["64"]["calls_per_s"] / out["ours"]["A"]["64"]["calls_per_s"], 3)
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
    if arms:
        print("tool service, A at 64 in flight, share of in-process calls/s: "
              + ", ".join(f"{a} {out[f'{a}_share_A64']:.1%}" for a in arms)
              + " (targets: service_handle >= 85%, service_http >= 70%)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
