"""Where the time of a `make demo` run goes: wall seconds per phase and per stage of a finished demo run.

    .venv/bin/python bench/demo_profile.py [--home .rstar2] [--flow-run ID] [--baseline HOME[:ID]] [--json]

Reads what the run left behind, nothing re-timed: `<home>/demo-timings.jsonl` (scripts/demo.sh) and the
stage timings of the run's MLflow parent run (`tasks.summary.stage_timings`, the code the run's own summary
uses). `--baseline` puts another finished run beside it: speed claims compare two runs measured back to
back, each with its load average. See docs/benchmarks-training.md, "bench/demo_profile.py".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def demo_record(home: Path, flow_run_id: str | None) -> dict:
    """The demo-timings.jsonl record of `flow_run_id` (default: the latest one) under `home`."""
    path = home / "demo-timings.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run `make demo` (scripts/demo.sh writes it) or pass --home")
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if flow_run_id:
        recs = [r for r in recs if r["flow_run_id"] == flow_run_id]
        if not recs:
            raise SystemExit(f"no demo run {flow_run_id} in {path}")
    return recs[-1]


def profile(home: Path, flow_run_id: str | None = None) -> dict:
    """Phases and stage timings of one finished demo run under `home` (its RSTAR2_HOME)."""
    rec = demo_record(home.resolve(), flow_run_id)
    os.environ["RSTAR2_HOME"] = str(home.resolve())  # the run's default state folder: its MLflow DB and store
    from rstar2_core.config import load_config
    from tasks import tracking
    from tasks.run_store import RunStore
    from tasks.summary import critical_path, stage_timings

    cfg = load_config(rec["profile"], rec["overrides"])
    store = RunStore.for_run(cfg.resolved_storage_root(), rec["flow_run_id"])
    parent_id = store.tracking_id("parent")
    if parent_id is None:
        raise SystemExit(f"run {rec['flow_run_id']} has no MLflow parent run in {store.root} (did it start?)")
    parent = tracking.client(cfg).get_run(parent_id)
    t_parent = parent.info.start_time / 1000
    timings = stage_timings(cfg, parent_id)
    path = critical_path(timings)
    first = min((t.start_s for t in timings), default=0.0)
    last = max((t.end_s for t in timings), default=0.0)
    phases = {"setup_s": rec["t_script"] - rec["t_start"], "services_s": rec["t_services"] - rec["t_script"],
              "deploy_s": rec["t_deploy"] - rec["t_services"], "flow_start_s": t_parent - rec["t_deploy"],
              "dispatch_s": first, "stages_s": last - first, "tail_s": rec["t_run"] - (t_parent + last)}
    reg = store.load("register") or {}
    return {"flow_run_id": rec["flow_run_id"], "at": rec["at"], "rc": rec["rc"], "quick": rec["quick"],
            "overrides": rec["overrides"], "total_s": round(rec["t_run"] - rec["t_start"], 1),
            "phases": {k: round(v, 1) for k, v in phases.items()},
            "stages": [{"stage": t.stage, "start_s": round(t.start_s, 1), "wall_s": round(t.wall_s, 1),
                        "critical": t in path} for t in timings],
            "critical_path": [t.stage for t in path],
            "pass1": {s["stage"]: s["primary_pass1"] for s in reg.get("stages", [])},
            "promotion": (reg.get("promotion") or {}).get("line"),
            "load": {"start": rec["load_start"], "end": rec["load_end"], "mean_1min": rec["load_mean"]}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", type=Path, default=Path(os.environ.get("RSTAR2_HOME", ROOT / ".rstar2")),
                    help="the demo's RSTAR2_HOME (default: $RSTAR2_HOME or .rstar2)")
    ap.add_argument("--flow-run", default=None, help="flow run id (default: the latest demo run under --home)")
    ap.add_argument("--baseline", default=None, metavar="HOME[:ID]", help="another demo run to compare with")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    r = profile(a.home, a.flow_run)
    base = None
    if a.baseline:
        home, _, fid = a.baseline.partition(":")
        base = profile(Path(home), fid or None)
    bw = {s["stage"]: s["wall_s"] for s in base["stages"]} if base else {}
    print(f"demo run {r['flow_run_id']} ({r['at']}, rc {r['rc']}{', quick' if r['quick'] else ''}): "
          f"{r['total_s']:.0f} s; load start {r['load']['start']}, end {r['load']['end']}, mean {r['load']['mean_1min']}")
    if base:
        print(f"baseline {base['flow_run_id']} ({base['at']}): {base['total_s']:.0f} s; load start "
              f"{base['load']['start']}, end {base['load']['end']}, mean {base['load']['mean_1min']}")
    head = f"{'phase / stage':34s} {'start s':>8s} {'wall s':>8s}" + (f" {'baseline':>9s} {'ratio':>6s}" if base else "")
    print(head)
    for k, v in r["phases"].items():
        b = base["phases"][k] if base else None
        print(f"{k:34s} {'':>8s} {v:8.1f}" + (f" {b:9.1f} {_ratio(v, b) or float('nan'):6.2f}" if base else ""))
    for s in r["stages"]:
        b = bw.get(s["stage"])
        mark = "*" if s["critical"] else " "
        print(f"  {mark} {s['stage']:30s} {s['start_s']:8.1f} {s['wall_s']:8.1f}"
              + (f" {b if b is not None else float('nan'):9.1f} {_ratio(s['wall_s'], b) or float('nan'):6.2f}" if base else ""))
    print("* = on the critical path; pass@1: " + ", ".join(f"{k} {v:.3f}" for k, v in r["pass1"].items()
                                                           if v is not None))
    if r["promotion"]:
        print(f"promotion: {r['promotion']}")
    if base:
        r["baseline"] = base
        r["ratios"] = {"total": _ratio(r["total_s"], base["total_s"]),
                       **{k: _ratio(v, base["phases"][k]) for k, v in r["phases"].items()},
                       **{s["stage"]: _ratio(s["wall_s"], bw.get(s["stage"])) for s in r["stages"]}}
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
