"""A Ray driver process for the multi-node tests: runs one RL stage on a live cluster (the config's
`cluster.ray_address`) and prints one JSON line per step, the steps' rollouts (`{"trace": ...}` lines,
tests/rollout_trace.py), then `{"result": ...}` or `{"error": ...}`; or,
with `--probe`, prints what the cluster holds (live nodes, placement groups, live actors); with `--gang`,
places a layout while a blocker holds one node's GPU (the test loses a node meanwhile).

    python tests/cluster/stage_driver.py --overrides '[...]' --init URL --data URL --out URL
    python tests/cluster/stage_driver.py --probe 127.0.0.1:PORT
    python tests/cluster/stage_driver.py --gang 127.0.0.1:PORT --overrides '[...]'

The tests run it as a subprocess: the pytest process may already drive a local Ray of its own."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/: rollout_trace


def _probe(address: str) -> dict:
    import ray
    from ray._private import state

    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        from rstar2_core.runtime.ray.placement import live_nodes

        nodes = live_nodes()
        pgs = [pg["state"] for pg in ray.util.placement_group_table().values()]
        actors = [a.get("State") for a in state.actors().values()]
        return {"nodes": [{"id": n.node_id, "total": n.total, "available": n.available, "head": n.head}
                          for n in nodes],
                "dead_nodes": [n["NodeID"] for n in ray.nodes() if not n.get("Alive")],
                "placement_groups": pgs, "live_actors": sum(1 for s in actors if s not in ("DEAD",))}
    finally:
        ray.shutdown()


def _gang(address: str, overrides: list[str]) -> dict:
    """Hold one worker node's GPU with a blocker group, then place the layout of `overrides`: one of its
    groups waits. Prints `{"blocked": node}`, then `{"waiting": n}` once the layout's groups exist and one
    is pending (so the test loses a node while the gang waits, not before its first fit)."""
    import threading

    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from rstar2_core.config import load_config
    from rstar2_core.runtime.ray.placement import create_placement_groups, remove_placement_groups
    from rstar2_core.runtime.specs import layout_for

    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        blocker = placement_group([{"GPU": 1.0}], strategy="STRICT_PACK", name="t-gang-blocker")
        ray.get(blocker.ready(), timeout=60)
        print(json.dumps({"blocked": placement_group_table(blocker)["bundles_to_node_id"][0]}), flush=True)

        def report_waiting() -> None:
            while True:
                ours = [g["state"] for g in placement_group_table().values() if g["name"].startswith("t-gang-rstar2")]
                if "PENDING" in ours:
                    print(json.dumps({"waiting": len(ours)}), flush=True)
                    return
                time.sleep(0.2)

        threading.Thread(target=report_waiting, daemon=True).start()
        t0 = time.monotonic()
        try:
            pgs = create_placement_groups(layout_for(load_config("tiny", overrides)), timeout_s=300,
                                          prefix="t-gang-")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
        remove_placement_groups(pgs)
        return {"placed": len(pgs), "seconds": time.monotonic() - t0}
    finally:
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--probe")
    p.add_argument("--gang")
    p.add_argument("--overrides", default="[]")
    p.add_argument("--init")
    p.add_argument("--data")
    p.add_argument("--out")
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if a.probe:
        print(json.dumps({"probe": _probe(a.probe)}), flush=True)
        return 0
    if a.gang:
        print(json.dumps({"gang": _gang(a.gang, json.loads(a.overrides))}), flush=True)
        return 0
    from rollout_trace import recording, trace_lines

    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.rl.stage import run_rl_stage
    from tasks.retry import is_infrastructure_error

    cfg = load_config("tiny", json.loads(a.overrides))
    storage.configure_s3(endpoint_url=cfg.storage.s3_endpoint_url, region=cfg.storage.s3_region)

    def log(metrics: dict, step: int) -> None:
        print(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}), flush=True)

    t0 = time.monotonic()
    trace: list = []
    try:
        with recording(trace, cfg.rl.seed):
            res = run_rl_stage(cfg, 0, init_checkpoint_url=a.init, data_url=a.data, out_url=a.out, log_metrics=log)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which asserts on it
        print("\n".join(trace_lines(trace)), flush=True)
        print(json.dumps({"error": type(e).__name__, "message": str(e), "retryable": is_infrastructure_error(e),
                          "nodes": getattr(e, "nodes", None), "seconds": time.monotonic() - t0}), flush=True)
        return 1
    print("\n".join(trace_lines(trace)), flush=True)
    print(json.dumps({"result": {"checkpoint_url": res.checkpoint_url}, "seconds": time.monotonic() - t0}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
