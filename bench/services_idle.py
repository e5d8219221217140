"""CPU the demo's local services burn while no run is going: CPU seconds per wall second of each service's
process tree (Prefect server, Prefect worker, MLflow UI) over an idle window.

    .venv/bin/python bench/services_idle.py [--home .rstar2] [--seconds 60] [--json]

Reads the PIDs scripts/services.sh wrote and sums each process tree's CPU times (/proc/<pid>/stat) at the
start and end of the window. Run it with the services up and nothing scheduled.
See docs/benchmarks-training.md, "bench/services_idle.py".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_s(pid: int) -> float | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(x) for x in f[11:15]) / TICK  # utime, stime, and those of its reaped children


def sample(pids: dict[str, int]) -> dict[str, dict[int, float]]:
    out = {}
    for name, pid in pids.items():
        out[name] = {p: c for p in tree(pid) if (c := cpu_s(p)) is not None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("RSTAR2_HOME", ROOT / ".rstar2")))
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    pids = {}
    for f in sorted((a.home / "pids").glob("*.pid")):
        pid = int(f.read_text().strip())
        if Path(f"/proc/{pid}").exists():
            pids[f.stem] = pid
    if not pids:
        raise SystemExit(f"no running service under {a.home}/pids: start them with scripts/services.sh up")
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    t0, s0 = time.time(), sample(pids)
    time.sleep(a.seconds)
    t1, s1 = time.time(), sample(pids)
    dt = t1 - t0
    # a process seen only at the end counts from 0 (it started inside the window); one that ended inside it
    # reaches its parent's reaped-children time (overcounting what it used before the window)
    per = {n: round(sum(c - s0[n].get(p, 0.0) for p, c in s1[n].items()) / dt, 4) for n in pids}
    r = {"seconds": round(dt, 1), "cpu_per_s": per, "total_cpu_per_s": round(sum(per.values()), 4),
         "processes": {n: len(s1[n]) for n in pids},
         "load": {"start": load0, "end": Path("/proc/loadavg").read_text().split()[:3]}}
    for n in pids:
        print(f"{n:16s} {per[n]:7.4f} CPU-s per s ({r['processes'][n]} processes)")
    print(f"{'total':16s} {r['total_cpu_per_s']:7.4f} CPU-s per s over {dt:.0f} s; load {r['load']}")
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
