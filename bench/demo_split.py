"""How the demo's stages should share two cores: one thread or two per stage, and an evaluation beside the next
RL stage or after it, measured side by side in one run from a demo run's own checkpoints.

    .venv/bin/python bench/demo_split.py --home .rstar2 [--flow-run ID] [--rl-steps 4] [--hs-problems 32] [--json]

Runs the real stage functions (`run_rl_stage`, `evaluate`, `select_hard_subset`), each in its own process
with a given number of torch threads, on the SFT checkpoint and RL pool of a finished (or partly
finished) demo run. See docs/benchmarks-training.md, "bench/demo_split.py".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def _load(home: Path, flow_run: str | None):
    os.environ["RSTAR2_HOME"] = str(home.resolve())
    from demo_profile import demo_record

    from rstar2_core.config import load_config
    from tasks.run_store import RunStore

    rec = demo_record(home.resolve(), flow_run)
    cfg = load_config(rec["profile"], rec["overrides"])
    store = RunStore.for_run(cfg.resolved_storage_root(), rec["flow_run_id"])
    sft, curated = store.load("sft"), store.load("curate")
    if sft is None or curated is None:
        raise SystemExit(f"run {rec['flow_run_id']} has no finished SFT and curation yet")
    return rec, sft.checkpoint_url, curated.url


def worker(job: dict) -> dict:
    """One arm in this process: `job` = {kind, threads, profile, overrides, sft_url, data_url, out_url, ...}."""
    import torch

    torch.set_num_threads(job["threads"])
    from rstar2_core.config import load_config

    cfg = load_config(job["profile"], job["overrides"])
    t0 = time.perf_counter()
    if job["kind"] == "rl":
        from rstar2_core.rl.stage import run_rl_stage

        run_rl_stage(cfg, 0, init_checkpoint_url=job["sft_url"], data_url=job["data_url"], out_url=job["out_url"],
                     resume=False)
    elif job["kind"] == "eval":
        from rstar2_core.eval.run import evaluate

        evaluate(cfg, checkpoint_url=job["sft_url"], out_url=job["out_url"], progress=False)
    elif job["kind"] == "hs":
        from rstar2_core.rl.hard_subset import select_hard_subset

        select_hard_subset(cfg, len(cfg.rl.stages) - 1, checkpoint_url=job["sft_url"], data_url=job["data_url"],
                           out_url=job["out_url"])
    else:
        raise ValueError(f"unknown arm kind {job['kind']!r}")
    return {"seconds": time.perf_counter() - t0}


def _start(job: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(job)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)


def _finish(p: subprocess.Popen, name: str) -> float:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"arm {name} failed (exit {p.returncode})")
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("RSTAR2_HOME", ROOT / ".rstar2")))
    ap.add_argument("--flow-run", default=None)
    ap.add_argument("--rl-steps", type=int, default=4)
    ap.add_argument("--hs-problems", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return 0
    rec, sft_url, pool_url = _load(a.home, a.flow_run)
    from rstar2_core import storage
    from rstar2_core.rl.data import read_rows

    rows = [r for r in read_rows(pool_url) if "__invalid__" not in r]
    work = Path(tempfile.mkdtemp(prefix="demo-split-", dir=a.home.resolve() / "bench" if (a.home / "bench").exists()
                                 else None))
    import pyarrow as pa
    import pyarrow.parquet as pq

    small = work / "pool-head.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:a.hs_problems]), small)
    base = {"profile": rec["profile"], "sft_url": sft_url, "data_url": pool_url,
            "overrides": rec["overrides"] + [f"rl.stages.0.steps={a.rl_steps}"]}

    def job(kind: str, threads: int, tag: str, **kw) -> dict:
        return {**base, "kind": kind, "threads": threads, "out_url": storage.join(work.as_uri(), tag), **kw}

    load0 = Path("/proc/loadavg").read_text().split()[:3]
    arms: dict[str, float] = {}
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    for name, j in (("rl_1t", job("rl", 1, "rl-1t")), ("eval_1t", job("eval", 1, "eval-1t")),
                    ("rl_2t", job("rl", 2, "rl-2t")), ("eval_2t", job("eval", 2, "eval-2t"))):
        arms[name] = _finish(_start(j), name)
        log(f"{name}: {arms[name]:.1f} s")
    t0 = time.perf_counter()
    pr, pe = _start(job("rl", 1, "rl-together")), _start(job("eval", 1, "eval-together"))
    arms["together_rl"], arms["together_eval"] = _finish(pr, "together rl"), _finish(pe, "together eval")
    arms["together"] = time.perf_counter() - t0
    log(f"together: {arms['together']:.1f} s (rl {arms['together_rl']:.1f}, eval {arms['together_eval']:.1f})")
    arms["hs_1t"] = _finish(_start(job("hs", 1, "hs-1t", data_url=small.as_uri())), "hs_1t")
    log(f"hs_1t ({a.hs_problems} problems): {arms['hs_1t']:.1f} s")
    r = {"arms": {k: round(v, 1) for k, v in arms.items()}, "rl_steps": a.rl_steps, "hs_problems": a.hs_problems,
         "pool": len(rows), "hs_projected_s": round(arms["hs_1t"] * len(rows) / a.hs_problems, 0),
         "ratios": {"rl_2t_vs_1t": round(arms["rl_2t"] / arms["rl_1t"], 3),
                    "eval_2t_vs_1t": round(arms["eval_2t"] / arms["eval_1t"], 3),
                    "together_vs_serial": round(arms["together"] / (arms["rl_1t"] + arms["eval_1t"]), 3),
                    "together_vs_serial_2t": round(arms["together"] / (arms["rl_2t"] + arms["eval_2t"]), 3)},
         "flow_run_id": rec["flow_run_id"], "work": str(work),
         "load": {"start": load0, "end": Path("/proc/loadavg").read_text().split()[:3]}}
    print(f"RL {a.rl_steps} steps: 1 thread {arms['rl_1t']:.1f} s, 2 threads {arms['rl_2t']:.1f} s; eval: 1 thread "
          f"{arms['eval_1t']:.1f} s, 2 threads {arms['eval_2t']:.1f} s; together (1 thread each) {arms['together']:.1f} s "
          f"vs one after the other {arms['rl_1t'] + arms['eval_1t']:.1f} s (1 thread) / "
          f"{arms['rl_2t'] + arms['eval_2t']:.1f} s (2 threads)")
    print(f"hard subset: {arms['hs_1t']:.1f} s for {a.hs_problems} problems -> ~{r['hs_projected_s']:.0f} s for the "
          f"run's pool of {len(rows)}; load {r['load']}")
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
