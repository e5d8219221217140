"""The Ray runtime across nodes, on a real multi-node Ray cluster on this machine (a head and two worker
nodes, each its own raylet: rstar2_core/runtime/ray/rehearsal/local_cluster.py, what `rstar2 cluster up` starts),
with the rehearsal layout (scripts/cluster-rehearsal.overrides: one logical GPU per worker node holding
trainer rank i and engine i, a sandbox actor beside them) and the store on S3 (a moto server).

- `rstar2 plan --address` says whether a layout fits the live cluster, naming what each node lacks;
- a layout the cluster cannot hold fails fast (`LayoutDoesNotFit`, retryable), not after the placement
  timeout, and holds nothing; a `file://` store not declared shared is refused on the multi-node cluster;
- a straight run places its ranks and engines on both worker nodes and writes step checkpoints whose trainer
  shards (one per rank, written from each rank's node) are complete and readable by the driver;
- a worker node's raylet SIGKILLed in step 2 (`kill-node`) stops the stage with `NodeLost` naming the
  node and the actors it held (retryable), leaves no actor or placement group holding resources; a retry
  while the node is down fails fast; once the node is back the retry resumes at step 2 and its steps
  equal the straight run's (up to a near-tie in sampling: tests/stage_compare.py `assert_same_steps`);
- `rstar2 cluster up | status | restart | down` start, heal and stop a cluster by its recorded PIDs.

Each run is a separate Ray driver process (tests/cluster/stage_driver.py): this pytest process may drive
its own local Ray for other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepspeed  # noqa: F401  (the code under test imports it: a missing install fails, never skips)
import pytest
from kept_logs import kept_if_a_test_fails
from s3_server import AWS_TEST_CREDENTIALS, moto_s3
from stage_compare import OVERRIDES, assert_same_steps

from rstar2_core import storage
from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("stage_driver.py")
REGION, BUCKET = "eu-west-1", "rstar2-mn"
AWS = {**AWS_TEST_CREDENTIALS, "AWS_DEFAULT_REGION": REGION}


def _rehearsal() -> list[str]:
    from rstar2_cli.cluster import rehearsal_overrides

    return rehearsal_overrides()


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET, REGION) as endpoint:     # the AWS test credentials in the environment meanwhile
        yield endpoint


@pytest.fixture(scope="module")
def cluster(s3, request):
    from rstar2_core.config import load_config

    root = tempfile.mkdtemp(prefix="rstar2-mn-", dir="/tmp")     # Ray's socket paths must stay short
    with kept_if_a_test_fails(request, root, "the cluster's node logs"), \
            LocalCluster.for_config(load_config("tiny", _rehearsal()).cluster, root, env=AWS) as c:
        yield c


@pytest.fixture(scope="module")
def toy_s3(toy_policy, s3):
    """The toy policy and its RL set, copied to S3: every node reads them from there."""
    from rstar2_core.models.io import local_checkpoint_dir

    storage.configure_s3(endpoint_url=s3, region=REGION)
    fs, _ = storage.fs_for(f"s3://{BUCKET}")
    fs.put(str(local_checkpoint_dir(toy_policy[0])), f"{BUCKET}/toy/sft", recursive=True)
    data = f"s3://{BUCKET}/toy/rl.jsonl"
    storage.write_text_atomic(data, storage.read_text(toy_policy[1]))
    return f"s3://{BUCKET}/toy/sft", data


def _overrides(cluster, s3, *extra: str, s3_root: bool = True) -> list[str]:
    """The toy stage on the rehearsal layout at `cluster`, its store on S3 (`s3_root=False`: the default
    file://<state dir>/artifacts, not declared shared; the toy inputs stay on S3 either way)."""
    root = [f'storage.root="s3://{BUCKET}/runs"'] if s3_root else []
    return [*OVERRIDES, *_rehearsal(), "rl.zero_stage=2", f'cluster.ray_address="{cluster.address}"',
            "storage.shared_filesystem=false", *root, f'storage.s3_endpoint_url="{s3}"',
            f'storage.s3_region="{REGION}"', *extra]


def _drive(cluster, s3, toy, out: str, *extra: str, fault: str | None = None, timeout: float = 420,
           s3_root: bool = True) -> dict:
    """Run the stage in a driver process; {"steps": {step: metrics}, "trace": [step rollouts],
    "result"|"error": ...}."""
    env = {**os.environ, **AWS}
    env.pop("RSTAR2_FAULT_INJECT", None)
    if fault:
        env["RSTAR2_FAULT_INJECT"] = fault
    cmd = [sys.executable, str(DRIVER), "--overrides", json.dumps(_overrides(cluster, s3, *extra, s3_root=s3_root)),
           "--init", toy[0], "--data", toy[1], "--out", out]
    p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out_: dict = {"steps": {}, "trace": []}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if "step" in rec:
                out_["steps"][rec["step"]] = rec["metrics"]
            elif "trace" in rec:
                out_["trace"].append(rec["trace"])
            else:
                out_.update(rec)
    assert "result" in out_ or "error" in out_, f"driver said neither (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return out_


def _probe(cluster) -> dict:
    p = subprocess.run([sys.executable, str(DRIVER), "--probe", cluster.address], check=False, cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return next(json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"probe"'))["probe"]


def _assert_nothing_held(cluster) -> None:
    """No live actor, every placement group removed, every live node's CPUs and GPUs free."""
    deadline = time.monotonic() + 30
    while True:
        pr = _probe(cluster)
        free = all(n["available"].get(r, 0.0) == n["total"].get(r, 0.0) for n in pr["nodes"] for r in ("CPU", "GPU"))
        if (pr["live_actors"] == 0 and set(pr["placement_groups"]) <= {"REMOVED"} and free) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert pr["live_actors"] == 0, pr
    assert set(pr["placement_groups"]) <= {"REMOVED"}, pr
    assert free, pr["nodes"]


def _plan(cluster, *extra: str) -> dict:
    args = [a for o in [*_rehearsal(), *extra] for a in ("--set", o)]
    p = subprocess.run([str(Path(sys.executable).with_name("rstar2")), "plan", *args, "--address", cluster.address,
                        "--json"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


def test_plan_says_whether_the_layout_fits_the_live_cluster(cluster):
    fits = _plan(cluster)
    assert fits["problems"] == [], fits["problems"]
    assert any("the layout fits" in x for x in fits["live_cluster"])
    status = {c["item"]: (c["status"], c["why_not_checked"]) for c in fits["checklist"]}
    assert status["live_cluster"] == ("ok", None)
    assert status["devices"][0] == "not checked" and "computes on the CPU" in status["devices"][1]
    big = _plan(cluster, "cluster.nodes=3")
    assert any("does NOT fit" in x for x in big["live_cluster"])
    (problem,) = big["problems"]
    assert "rstar2-node2" in problem and "lacks 1 GPU" in problem and "head" in problem
    assert [c["status"] for c in big["checklist"] if c["item"] == "live_cluster"] == ["problem"]


def test_a_layout_the_cluster_cannot_hold_fails_fast(cluster, s3, toy_s3):
    run = _drive(cluster, s3, toy_s3, f"s3://{BUCKET}/runs/too-big", "cluster.nodes=3",
                 "cluster.placement_timeout_s=600")
    # LayoutDoesNotFit comes from the fit check only; waiting out the timeout would be PlacementTimeout
    assert run["error"] == "LayoutDoesNotFit" and run["retryable"], run
    assert "rstar2-node2" in run["message"] and "lacks 1 GPU" in run["message"]
    _assert_nothing_held(cluster)


def test_a_node_local_store_is_refused_on_a_multi_node_cluster(cluster, s3, toy_s3, tmp_path):
    """A one-node layout (CPU only: the config cannot tell) on the 3-node cluster with a file:// store not
    declared shared: refused when the runtime starts, before any actor, and not retried."""
    run = _drive(cluster, s3, toy_s3, (tmp_path / "out").as_uri(), "cluster.nodes=1", "cluster.gpus_per_node=0",
                 "cluster.logical_gpus=false", s3_root=False)
    assert run["error"] == "ConfigError" and not run["retryable"], run
    assert "3 live nodes" in run["message"] and "storage.shared_filesystem = true" in run["message"]
    _assert_nothing_held(cluster)


def test_lost_node_is_retryable_and_the_retry_resumes_to_the_straight_runs_steps(cluster, s3, toy_s3):
    from rstar2_core.runtime.checkpoint import read_rank_state, saved_world_size

    straight = _drive(cluster, s3, toy_s3, f"s3://{BUCKET}/runs/straight")
    assert "result" in straight, straight
    steps = {int(k): v for k, v in straight["steps"].items()}
    assert sorted(steps) == [1, 2, 3]
    assert any(m.get("actor/skipped") == 0.0 for m in steps.values())       # an update really happened
    assert all(m["runtime/nodes"] == 2 for m in steps.values())             # the ranks and engines on 2 nodes
    # the step checkpoints hold both ranks' shards, each written from its own node, readable here
    storage.configure_s3(endpoint_url=s3, region=REGION)
    ckpts = sorted(u for u in storage.list_dirs(f"s3://{BUCKET}/runs/straight/steps") if storage.is_complete(u))
    assert ckpts, "no complete step checkpoint on S3"
    assert saved_world_size(ckpts[-1]) == 2
    assert all(read_rank_state(ckpts[-1], r, 2) is not None for r in range(2))
    _assert_nothing_held(cluster)

    out = f"s3://{BUCKET}/runs/faulty"
    lost = _drive(cluster, s3, toy_s3, out, fault="rl-stage-1:step=2:kill-node")
    assert lost["error"] == "NodeLost" and lost["retryable"], lost
    ((node, actors),) = lost["nodes"].items()
    assert {"engine-1", "trainer-1"} <= set(actors) and node in lost["message"], lost
    assert sorted(int(k) for k in lost["steps"]) == [1]
    _assert_nothing_held(cluster)

    down = _drive(cluster, s3, toy_s3, out)          # the node is still gone: the layout no longer fits
    assert down["error"] == "LayoutDoesNotFit" and down["retryable"], down

    assert cluster.restart_dead_nodes(), cluster.describe()      # the node is back
    resumed = _drive(cluster, s3, toy_s3, out)
    assert "result" in resumed, resumed
    got = {int(k): v for k, v in resumed["steps"].items()}
    assert sorted(got) == [2, 3]
    # the rollouts of step 1 (the lost attempt) and steps 2-3 (the retry) against the straight run's
    assert_same_steps(sorted(steps.items()), sorted(got.items()), straight["trace"], lost["trace"] + resumed["trace"])
    _assert_nothing_held(cluster)


def test_a_node_lost_while_the_gang_waits_fails_it_fast(cluster):
    """One of the layout's two groups waits (a blocker holds a worker's GPU); the other worker is lost
    meanwhile: the layout no longer fits, and the wait ends in `LayoutDoesNotFit` (the refit) instead of
    at the placement timeout (300 s here), with every group removed."""
    p = subprocess.Popen([sys.executable, str(DRIVER), "--gang", cluster.address, "--overrides",
                          json.dumps(_rehearsal())], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        blocked = json.loads(p.stdout.readline())["blocked"]
        assert json.loads(p.stdout.readline())["waiting"] >= 2     # the groups exist and one waits for that GPU
        other = next(i for i in range(1, len(cluster.nodes)) if cluster.node_id(i) != blocked)
        cluster.kill_node(other)
        out, _ = p.communicate(timeout=240)
    finally:
        p.kill()
    gang = next(json.loads(x) for x in out.splitlines() if x.startswith('{"gang"'))["gang"]
    assert gang["error"] == "LayoutDoesNotFit", gang    # the refit, not the timeout (PlacementTimeout)
    assert cluster.restart_dead_nodes() == [other], cluster.describe()
    _assert_nothing_held(cluster)


def test_the_cluster_command_starts_restarts_and_stops_a_local_cluster(tmp_path):
    """`rstar2 cluster up | status | restart | down` as the README runs them (one worker node here)."""
    import psutil

    env = {**os.environ, "RSTAR2_HOME": str(tmp_path / "home"), "RAY_AUTH_MODE": "disabled"}
    rstar2 = str(Path(sys.executable).with_name("rstar2"))

    def run(*args: str) -> str:
        p = subprocess.run([rstar2, "cluster", *args], check=False, cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=180)
        assert p.returncode == 0, (args, p.stdout, p.stderr[-3000:])
        return p.stdout

    def alive(pid: int, started: float) -> bool:
        try:
            p = psutil.Process(pid)
            return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    up = run("up", "--set", "cluster.nodes=1")
    record = tmp_path / "home" / "cluster" / "cluster.json"
    try:
        state = json.loads(record.read_text())
        assert "head + 1 worker node(s) x 1 logical GPU, 4 CPU" in up and state["address"] in up
        assert run("status").count("node ") == 2
        LocalCluster.attach(state).kill_node(1)            # what a kill-node fault does to it
        assert "restarted worker node(s) [1]" in run("restart")
        assert "GPU 1 free of 1" in run("status")
        latest = json.loads(record.read_text())        # the restarted node's new PIDs
        leaders = {n["pid"]: n["procs"][str(n["pid"])] for n in latest["nodes"]}
        assert len(leaders) == 2 and all(alive(p, t) for p, t in leaders.items()), latest  # what `down` must end
    finally:
        down = run("down")
    assert "stopped" in down and not record.exists()
    procs = {int(p): t for rec in (state, latest) for n in rec["nodes"] for p, t in n["procs"].items()}
    assert len(procs) >= 6                              # ray start, raylet, ... of 2 nodes and a restart
    assert not [p for p, t in procs.items() if alive(p, t)]
