"""End to end through real services: scripts/services.sh starts a Prefect server and a process worker
(as `make demo` does), prefect.yaml is deployed, and the failure rehearsal `scripts/demo.sh --quick --fault
...` (what `make demo-fault` runs, here with two faults) runs `rstar2/full-recipe` at the quick demo's sizes
(scripts/demo-quick.overrides) with the faults injected into that flow run only. Between the first failure
and its retry the profile on disk is edited (`[rl] lr`). Each failure is retried through the API exactly as
one of Prefect's UIs' Retry does; the test then checks that finished stages were not recomputed, each failed
RL stage resumed from its step checkpoint into the same MLflow run with no step lost or repeated, the
resumed and later RL stages trained with the run's frozen lr (not the edited one), MLflow's params are the
run's config snapshot, one model version was registered, MLflow holds one parent run with its nested stage
runs, and the run's summary (stage table, promotion, plot) is printed."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from uuid import UUID

import pytest
from deployment_services import E2E_EXTRA, E2E_OVERRIDES, NO_RAY, QUICK, ROOT, attempt_process_exited

FAULTS = "rl-stage-1:step=2,rl-stage-2:step=1"   # the quick recipe's stage 2 has one step


@pytest.mark.slow
def test_fault_retry_resume_through_the_deployment(stack):
    """Two failures in one flow run, each retried as one of Prefect's UIs does (`UI_RETRY_FORCE`: the v2
    UI's Retry, force=True, after RL stage 1's fault at step 2; the classic UI's, force=False, after RL stage
    2's at its first step, which the retry runs again from the stage's start), so both Retry buttons are
    covered by one quick recipe. HF engine: vLLM through a deployment runs in tests/rehearsal (every stage's
    engine) and a vLLM stage's retry in tests/vllm/test_vllm_stages.py."""
    from flows.client import retry_flow_run, watch
    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.rl.stage import stage_offset
    from tasks import tracking
    from tasks.run_store import RunStore

    home, profiles, env = stack.home, stack.profiles, stack.env       # the worker reads `profiles`
    cfg = load_config("tiny", E2E_OVERRIDES)
    lr = cfg.rl.lr
    demo = subprocess.run(["bash", "scripts/demo.sh", "--quick", "--fault", FAULTS], check=False, cwd=ROOT,
                          env={**env, "RSTAR2_DEMO_OVERRIDES": " ".join([*NO_RAY, *E2E_EXTRA])},
                          capture_output=True, text=True, timeout=900)
    assert demo.returncode == 1, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "QUICK MODE" in demo.stdout and f"fault {FAULTS}" in demo.stdout
    assert "injected fault in rl-stage-1 at step 2" in demo.stdout, demo.stdout[-3000:]
    fid = (home / "last-flow-run").read_text().strip()
    assert f"python -m flows.client retry {fid}" in demo.stdout and f"/v2/runs/flow-run/{fid}" in demo.stdout
    store = RunStore.for_run(cfg.resolved_storage_root(), str(fid))
    assert store.read_config_snapshot()["overrides"] == [*QUICK, "pipeline.task_retries=0", *NO_RAY, *E2E_EXTRA]
    first = {k: store.record(k) for k in ("curate", "sft-data", "base-model", "sft")}
    assert all(r is not None and r["attempt"] == 1 for r in first.values()), first
    assert store.record("rl-stage-1") is None
    rl_runs = {"rl-stage-1": store.tracking_id("rl-stage-1")}
    assert rl_runs["rl-stage-1"] is not None
    tiny = profiles / "tiny.toml"  # edit the profile between the failure and the retry (the stack restores it)
    assert lr == 3e-4 and "\nlr = 3e-4\n" in tiny.read_text()
    tiny.write_text(tiny.read_text().replace("\nlr = 3e-4\n", "\nlr = 1e-3\n"))
    assert load_config("tiny", E2E_OVERRIDES).rl.lr == 1e-3

    asyncio.run(attempt_process_exited(UUID(fid)))   # as a person does: after the failed process ended
    asyncio.run(retry_flow_run(fid, "v2"))           # the v2 UI's Retry: RL stage 1 resumes, stage 2 fails
    assert asyncio.run(watch(UUID(fid), timeout_s=900, quiet=True)) == "Failed", stack.worker_log()
    assert store.record("rl-stage-1")["attempt"] == 2 and store.record("rl-stage-2") is None
    rl_runs["rl-stage-2"] = store.tracking_id("rl-stage-2")
    assert rl_runs["rl-stage-2"] is not None
    asyncio.run(attempt_process_exited(UUID(fid), attempts=2))
    asyncio.run(retry_flow_run(fid, "classic"))      # the classic UI's Retry: RL stage 2 again, the run ends
    assert asyncio.run(watch(UUID(fid), timeout_s=900, quiet=True)) == "Completed", stack.worker_log()
    summary = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "flows.client", "summary", fid], check=False,
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "| rl-stage-3 |" in summary.stdout and "promotion (synthetic" in summary.stdout, summary.stdout
    plot = storage.to_local_path(store.url("summary", "recipe.png"))
    assert f"plot: {plot}" in summary.stdout and plot.exists()

    # finished stages were reused, not recomputed
    assert {k: store.record(k) for k in first} == first
    assert store.record("rl-stage-1")["attempt"] == 2 and store.record("rl-stage-2")["attempt"] == 3
    # each failed stage went on in the MLflow run it had started: every step exactly once, in order
    c = tracking.client(cfg)
    steps = {  # MLflow's step is the global RL step, counted on across the stages
        s.name: [stage_offset(cfg, i) + n for n in range(1, s.steps + 1)] for i, s in enumerate(cfg.rl.stages)}
    for stage, run_id in rl_runs.items():
        assert store.tracking_id(stage) == run_id
        step_keys = [k for k in c.get_run(run_id).data.metrics if k.startswith(("actor/", "rollout/"))]
        assert step_keys, stage
        for k in step_keys:
            assert tracking.metric_steps(cfg, run_id, k) == steps[stage], (stage, k)
    # one registered version for this recipe run, one parent run with its nested runs
    versions = c.search_model_versions(f"name='{cfg.tracking.registered_model}'")
    mine = [v for v in versions if v.tags.get("rstar2.recipe_run_id") == str(fid)]
    assert len(mine) == 1 and mine[0].tags["checkpoint_url"]
    exp = tracking.experiment_id(cfg)
    parents = c.search_runs([exp], f"tags.`prefect.flow_run_id` = '{fid}'")
    assert len(parents) == 1
    # both retries ran the frozen config: every RL stage's optimizer ran at the first attempt's peak lr (its
    # LR scheduler's base lr, saved in the stage's final checkpoint; stage 3 resets its optimizer, so it
    # rebuilds it from the config it is given), params = the snapshot, the drift logged at each attempt
    from rstar2_core.runtime.checkpoint import read_rank_state

    for stage in ("rl-stage-1", "rl-stage-2", "rl-stage-3"):
        sched = read_rank_state(store.load(stage).checkpoint_url, 0, 1)["scheduler"]
        assert sched["base_lrs"] == [pytest.approx(lr)], (stage, sched["base_lrs"])
    snap = store.read_config_snapshot()
    parent = parents[0].data
    assert parent.params["rl.lr"] == str(lr) and parent.tags["config_digest"] == snap["digest"]
    assert parent.params == {tracking.metric_key(k): v[:6000] for k, v in tracking.flatten(snap["config"]).items()}
    for attempt in (2, 3):
        assert "rl.lr: 0.0003 (run) vs 0.001 (now)" in parent.tags[f"rstar2.drift.attempt_{attempt}"]
    children = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert {"curate", "sft", "rl-stage-1", "rl-stage-2", "rl-stage-3", "eval-rl-stage-3"} <= {
        r.info.run_name for r in children}
    assert all(len([r for r in children if r.info.run_name == s]) == 1 for s in rl_runs)


# The same shrunk recipe on the Ray runtime across nodes: a local multi-node Ray cluster (a head and two
# worker nodes, each its own raylet: `rstar2 cluster up`'s LocalCluster) with the rehearsal layout
# (scripts/cluster-rehearsal.overrides: one logical GPU per worker node holding trainer rank i and engine
# i); Prefect tasks on that cluster (RayTaskRunner at cluster.ray_address), each stage driving its own
# engine actors (2), DeepSpeed trainer shards (2, ZeRO-2, gloo) and sandbox actor pool. Its test loses a
# worker node once (`kill-node`) and retries the failed run as the UI does once the node is back.
RAY_RUNTIME = ["cluster.use_ray=true", "rl.zero_stage=2", "sft.zero_stage=2"]


@pytest.mark.slow
def test_full_recipe_through_the_deployment_on_a_multi_node_cluster(stack):
    """The quick recipe on the Ray runtime placed across two worker nodes, with the node holding trainer
    rank 1 lost at RL stage 1's step 2 (task retries off): the failed flow run's message is the
    project's `NodeLost` naming the node and the actors it held (it crossed from the stage task's Ray
    worker to the flow pickled); once the node is back the UI's Retry resumes the run to the end, every
    RL step on both nodes."""
    from prefect.client.orchestration import get_client

    from flows.client import retry_flow_run, start_run, watch
    from rstar2_cli.cluster import rehearsal_overrides
    from rstar2_core.config import load_config
    from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster
    from tasks import tracking
    from tasks.run_store import RunStore

    # two evaluations (SFT's, the last stage's), not E2E_EXTRA's four: on this layout an evaluation holds both
    # nodes' GPUs between two stages (~45 s each beside another job), and this test checks none of them
    base = [o for o in E2E_OVERRIDES[len(NO_RAY):] if o not in E2E_EXTRA]
    base += ["pipeline.eval_stages=last", *RAY_RUNTIME, *rehearsal_overrides()]
    root = tempfile.mkdtemp(prefix="rstar2-e2e-mn-", dir="/tmp")      # Ray's socket paths must stay short
    try:
        with LocalCluster.for_config(load_config("tiny", base).cluster, root,
                                     env={"RSTAR2_HOME": str(stack.home)}) as cluster:
            overrides = [*base, f'cluster.ray_address="{cluster.address}"']
            cfg = load_config("tiny", overrides)
            fid = asyncio.run(start_run("rstar2/full-recipe", {"profile": "tiny", "overrides": overrides},
                                        env={"RSTAR2_FAULT_INJECT": "rl-stage-1:step=2:kill-node"}))
            assert asyncio.run(watch(fid, timeout_s=1800, quiet=True)) == "Failed", stack.worker_log()

            async def message() -> str:
                async with get_client() as c:
                    return (await c.read_flow_run(fid)).state.message or ""

            failed = asyncio.run(message())
            assert "NodeLost: Ray node lost mid-step: node " in failed and "RaySystemError" not in failed, failed
            assert "engine-1, trainer-1" in failed, failed
            asyncio.run(attempt_process_exited(fid))
            assert cluster.restart_dead_nodes(), cluster.describe()      # the node is back
            asyncio.run(retry_flow_run(fid))  # the UI's Retry
            state = asyncio.run(watch(fid, timeout_s=1800, quiet=True))
            assert state == "Completed", stack.worker_log()
    except BaseException:
        print(f"the cluster's node logs are kept in {root}")
        raise
    else:
        shutil.rmtree(root, ignore_errors=True)
    store = RunStore.for_run(cfg.resolved_storage_root(), str(fid))
    assert store.record("sft")["attempt"] == 1 and store.record("rl-stage-1")["attempt"] == 2
    c = tracking.client(cfg)
    runs = [c.get_run(store.tracking_id(stage)) for stage in ("rl-stage-1", "rl-stage-2", "rl-stage-3")]
    for run in runs:   # each stage ran its steps on 2 engine actors and 2 trainer ranks, over 2 nodes
        assert tracking.metric_steps(cfg, run.info.run_id, "rollout/trajectories")
        assert run.data.metrics["runtime/engines"] == 2 and run.data.metrics["runtime/trainer_ranks"] == 2
        assert run.data.metrics["runtime/nodes"] == 2
        assert run.data.metrics["total/usage/engine_device_s"] > 0
    assert tracking.metric_steps(cfg, runs[0].info.run_id, "rollout/trajectories") == [1, 2, 3]
    versions = c.search_model_versions(f"name='{cfg.tracking.registered_model}'")
    assert [v for v in versions if v.tags.get("rstar2.recipe_run_id") == str(fid)]
