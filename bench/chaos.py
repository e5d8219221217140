"""Benchmark: the quick recipe on the Ray runtime through a seeded schedule of faults, to the end.

    .venv/bin/python bench/chaos.py [--quick] [--json] [--seed 0] [--out DIR] [--sandbox ray|service]

The recipe (`flows.full_recipe` here; the quick demo's sizes, checkpoints every step, 3 task retries) runs on
a local Ray (engine actor, DeepSpeed trainer shard, sandbox actors) against real services it starts
(rstar2_cli/local_services.py: Prefect, moto S3 behind a closable endpoint, `mlflow server`). Faults (placed
by `--seed`): an engine actor, a trainer shard and a sandbox killed at RL steps (`RSTAR2_FAULT_INJECT`),
MLflow stopped and started, S3 closed for `--s3-outage-s` (30 s; 10 with --quick), after chosen stages.
`--sandbox service`: the tool service on a tool node of a local Ray cluster (as in production); `kill-sandbox`
kills a replica, and the run passes only if Serve replaced it. JSON keys: docs/benchmarks-training.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REGION, BUCKET = "eu-west-1", "rstar2-chaos"
RAY = ['cluster.runtime="ray"', "cluster.use_ray=true", 'rl.backend="deepspeed"', 'sft.backend="deepspeed"',
       'sandbox.backend="ray"', "rl.zero_stage=2", "sft.zero_stage=2", "cluster.trainer_ranks=1",
       f"cluster.cpus_per_node={max(2, os.cpu_count() or 2)}"]
SERVICE = ['sandbox.backend="service"', 'sandbox.service.connect="handle"', "sandbox.service.replicas=2",
           "sandbox.service.max_replicas=0", "sandbox.service.cpus_per_replica=1",
           'sandbox.service.node_resource="rstar2_tools"', "cluster.nodes=1", "cluster.gpus_per_node=1",
           "cluster.logical_gpus=true", "cluster.cpus_per_node=3", "cluster.cpus_per_gpu=2"]
"""`--sandbox service`: the tool service (2 replicas) on a tool node of its own, and the engine and the trainer
shard on a worker node's logical GPU (so that nothing of the layout lands on the tool node)."""
KILLS = ("kill-engine", "kill-trainer", "kill-sandbox")
SITES = [("rl-stage-1", 1), ("rl-stage-1", 2), ("rl-stage-1", 3), ("rl-stage-2", 1), ("rl-stage-3", 1)]
TRIGGERS = ["sft-data", "sft", "rl-stage-1", "rl-stage-2"]   # a service fault starts once this stage has finished


def schedule(seed: int) -> dict:
    """Where each fault happens: the kills at distinct RL (stage, step) sites, the service faults after
    distinct finished stages."""
    rng = random.Random(seed)
    sites = rng.sample(SITES, len(KILLS))
    after = rng.sample(TRIGGERS, 2)
    return {"kills": [(kind, stage, step) for kind, (stage, step) in zip(KILLS, sites, strict=True)],
            "s3_outage_after": after[0], "mlflow_restart_after": after[1]}


def quick_overrides() -> list[str]:
    from rstar2_cli.common import read_overrides_file

    return read_overrides_file(ROOT / "scripts" / "demo-quick.overrides")


class Chaos(threading.Thread):
    """Watches the run store through moto's own port (not the closable endpoint) and carries out the
    service faults when their stage has finished; prints progress with an ETA."""

    def __init__(self, moto_url: str, prefix: str, plan: dict, endpoint, mlflow, outage_s: float,
                 mlflow_down_s: float, stages: list[str]):
        super().__init__(daemon=True)
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=moto_url, region_name=REGION)
        self.prefix, self.plan, self.endpoint, self.mlflow = prefix, plan, endpoint, mlflow
        self.outage_s, self.mlflow_down_s, self.stages = outage_s, mlflow_down_s, stages
        self.done: dict[str, float] = {}
        self.events: list[dict] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def finished(self, stage: str) -> bool:
        try:
            self.s3.head_object(Bucket=BUCKET, Key=f"{self.prefix}/state/{stage}.json")
            return True
        except Exception:  # noqa: BLE001 - not there (yet)
            return False

    def _fault(self, name: str, down, up, seconds: float) -> None:
        t = time.monotonic()
        down()
        time.sleep(seconds)
        up()
        self.events.append({"fault": name, "at_s": round(t - self.t0, 1), "down_s": round(time.monotonic() - t, 1)})
        print(f"[chaos] {name}: down {time.monotonic() - t:.0f} s", flush=True)

    def run(self) -> None:
        pending = {"s3-outage": self.plan["s3_outage_after"], "mlflow-restart": self.plan["mlflow_restart_after"]}
        while not self.stop.wait(1.0):
            for s in self.stages:
                if s not in self.done and self.finished(s):
                    self.done[s] = time.monotonic() - self.t0
                    n, el = len(self.done), self.done[s]
                    eta = el / n * (len(self.stages) - n)
                    print(f"[chaos] {s} finished: {n}/{len(self.stages)} stages, {el:.0f} s, ETA ~{eta:.0f} s", flush=True)
            for name, after in list(pending.items()):
                if after in self.done:
                    del pending[name]
                    if name == "s3-outage":
                        self._fault(name, self.endpoint.down, self.endpoint.up, self.outage_s)
                    else:
                        self._fault(name, self.mlflow.stop, self.mlflow.start, self.mlflow_down_s)


@contextmanager
def service_cluster(cfg, overrides: list[str], root: Path):
    """For `--sandbox service`: a local Ray cluster (a head, one worker node, a tool node declaring
    `sandbox.service.node_resource`) with the tool service deployed by `rstar2 tools deploy`, as
    infra/k8s/up.sh does; yields (its address, a function returning `rstar2 tools status --json`)."""
    import subprocess

    from rstar2_cli.rehearsal_stack import free_port
    from rstar2_cli.tools import last_json, tool_node, tools_command
    from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster

    with LocalCluster.for_config(cfg.cluster, root, **tool_node(cfg.sandbox.service)) as cluster:   # this env
        def tools(action: str, *extra: str) -> dict:
            p = subprocess.run(tools_command(action, "tiny", overrides, cluster.address, *extra), cwd=str(ROOT),
                               capture_output=True, text=True, timeout=600, check=False)
            if action == "deploy" and p.returncode != 0:
                raise RuntimeError(f"rstar2 tools deploy failed (exit {p.returncode}): {p.stderr[-3000:]}")
            return last_json(p, f"rstar2 tools {action}")

        st = tools("deploy", "--http-host", "127.0.0.1", "--http-port", str(free_port()), "--timeout-s", "300")
        print(f"[chaos] tool service {st['status']} on {cluster.address}: {st['replica_actors']}", flush=True)
        yield cluster.address, lambda: tools("status", "--json")


async def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client

    from flows.client import task_runs

    async with get_client() as c:
        return await task_runs(c, flow_run_id)


def rl_metrics(cfg, store) -> tuple[bool, int, dict]:
    """(every RL step's metrics logged exactly once, points missing, per stage the steps of one key). Steps
    are global: stage i logs at its offset (the steps of the stages before it) + 1, 2, ..."""
    from rstar2_core.rl.stage import stage_offset
    from tasks import tracking

    once, lost, seen = True, 0, {}
    c = tracking.client(cfg)
    for i, st in enumerate(cfg.rl.stages):
        run_id = store.tracking_id(st.name)
        if run_id is None:
            once, lost = False, lost + st.steps
            continue
        keys = [k for k in c.get_run(run_id).data.metrics if k.startswith(("actor/", "rollout/"))]
        for k in keys:
            steps = tracking.metric_steps(cfg, run_id, k)
            expect = list(range(stage_offset(cfg, i) + 1, stage_offset(cfg, i) + st.steps + 1))
            once &= sorted(steps) == expect
            lost += len(set(expect) - set(steps))
        seen[st.name] = tracking.metric_steps(cfg, run_id, "rollout/trajectories") if keys else []
    return once, lost, seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S3 closed 10 s, MLflow down 3 s")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--s3-outage-s", type=float, default=None)
    ap.add_argument("--out", default=None, help="folder for the run's state and logs (default: a new one in /tmp)")
    ap.add_argument("--sandbox", choices=("ray", "service"), default="ray",
                    help="ray: sandbox actors in the runtime's placement (default); service: the tool service on "
                         "a tool node of a local Ray cluster, one of its replicas killed")
    a = ap.parse_args()
    outage_s = a.s3_outage_s if a.s3_outage_s is not None else (10.0 if a.quick else 30.0)
    mlflow_down_s = 3.0 if a.quick else 10.0
    out = Path(a.out or tempfile.mkdtemp(prefix="rstar2-chaos-", dir="/tmp")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = schedule(a.seed)
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.update({"RSTAR2_HOME": str(out / "home"), "PREFECT_HOME": str(out / "prefect"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "RSTAR2_RAY_TMP": f"/tmp/rstar2-ray-chaos-{os.getpid()}",
                       "RSTAR2_FAULT_INJECT": ",".join(f"{s}:step={k}:{kind}" for kind, s, k in plan["kills"])})
    print(f"[chaos] out {out}; faults: {json.dumps(plan)}", flush=True)

    from flows.client import expected_tasks
    from flows.full_recipe import full_recipe
    from rstar2_cli.local_services import FlakyEndpoint, MlflowServer, PrefectServer, moto_server
    from rstar2_core.config import load_config
    from tasks import tracking
    from tasks.run_store import RunStore

    run_id = f"chaos-{a.seed}-{int(time.time())}"
    t0 = time.monotonic()
    with PrefectServer(out), moto_server(BUCKET, REGION) as moto_url:
        endpoint = FlakyEndpoint("127.0.0.1", int(moto_url.rsplit(":", 1)[1]))
        mlflow = MlflowServer(out)
        mlflow.start()
        service = a.sandbox == "service"
        overrides = [*quick_overrides(), *RAY, *(SERVICE if service else []), "pipeline.eval_stages=rl",
                     "pipeline.task_retries=3", "rl.checkpoint_every=1", f'storage.root="s3://{BUCKET}/chaos"',
                     f'storage.s3_endpoint_url="{endpoint.url}"', f'storage.s3_region="{REGION}"',
                     f'tracking.tracking_uri="{mlflow.uri}"']
        ray_root = Path(tempfile.mkdtemp(prefix="rstar2-chaos-ray-", dir="/tmp"))   # Ray's socket paths stay short
        cluster = service_cluster(load_config("tiny", overrides), overrides, ray_root) if service else nullcontext((None, None))
        try:
            with cluster as (address, tools):
                if address:
                    overrides.append(f'cluster.ray_address="{address}"')
                before = tools() if tools else None
                cfg = load_config("tiny", overrides)
                stages = ["curate", "sft-data", "base-model", "sft", *[s.name for s in cfg.rl.stages]]
                chaos = Chaos(moto_url, f"chaos/runs/{run_id}", plan, endpoint, mlflow, outage_s, mlflow_down_s, stages)
                chaos.start()
                print(f"[chaos] the recipe ({expected_tasks({'profile': 'tiny', 'overrides': overrides})} tasks) "
                      f"starts; run id {run_id}", flush=True)
                state = full_recipe(profile="tiny", overrides=overrides, run_id=run_id, return_state=True)
                chaos.stop.set()
                chaos.join(timeout=120)
                wall = time.monotonic() - t0
                endpoint.up()
                store = RunStore.for_run(cfg.resolved_storage_root(), run_id)
                fired = [o["Key"].rsplit("/", 1)[1] for o in chaos.s3.list_objects_v2(
                    Bucket=BUCKET, Prefix=f"chaos/runs/{run_id}/").get("Contents", []) if "/faults/" in o["Key"]]
                tasks = asyncio.run(_task_runs(state.state_details.flow_run_id))
                retries = sum(max(0, (t.run_count or 1) - 1) for t in tasks)
                once, lost, steps = rl_metrics(cfg, store)
                versions = [v for v in tracking.client(cfg).search_model_versions(
                    f"name='{cfg.tracking.registered_model}'") if v.tags.get("rstar2.recipe_run_id") in (
                    run_id, str(state.state_details.flow_run_id))]
                after = tools() if tools else None
        finally:
            mlflow.stop()
            endpoint.close()
            shutil.rmtree(ray_root, ignore_errors=True)
    injected = len(fired) + len(chaos.events)
    completed = state.is_completed()
    r = {"bench": "chaos", "quick": a.quick, "seed": a.seed, "schedule": plan, "completed": completed,
         "faults_injected": injected,
         "faults_survived": injected if completed else sum(1 for f in fired if store.record(f.split("-step")[0])),
         "fired": sorted(fired), "service_faults": chaos.events, "retries": retries,
         "retried_tasks": sorted(t.name for t in tasks if (t.run_count or 1) > 1),
         "steps_trained_once": once, "rl_steps": steps, "versions_registered": len(versions),
         "lost_metrics": lost, "stage_done_s": {k: round(v, 1) for k, v in chaos.done.items()},
         "sandbox": a.sandbox, "wall_s": round(wall, 1), "load_1min": round(os.getloadavg()[0], 2), "out": str(out)}
    replaced = True
    if service:    # the killed replica was replaced: as many live replicas as before, one with a new name
        r["tool_service"] = {"replicas_before": before["replica_actors"], "replicas_after": after["replica_actors"],
                             "status_after": after["status"]}
        replaced = (after["status"] == "RUNNING" and len(after["replica_actors"]) == len(before["replica_actors"])
                    and len(set(after["replica_actors"]) - set(before["replica_actors"])) == 1)
        r["tool_service"]["replica_replaced"] = replaced
    shutil.rmtree(os.environ["RSTAR2_RAY_TMP"], ignore_errors=True)
    if not a.json:
        print(f"[chaos] {'completed' if completed else 'FAILED'} in {wall:.0f} s: {injected} faults, "
              f"{r['faults_survived']} survived, {retries} task retries, steps trained once: {once}, "
              f"{len(versions)} version(s) registered, {lost} metric points lost")
    print(json.dumps(r))
    return 0 if (completed and r["faults_survived"] == injected and once and lost == 0 and len(versions) == 1
                 and replaced) else 1


if __name__ == "__main__":
    sys.exit(main())
