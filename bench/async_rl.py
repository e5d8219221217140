"""Benchmark: synchronous RL steps vs asynchronous ones with a staleness bound of 1 and 2, same run.

    .venv/bin/python bench/async_rl.py [--quick] [--json] [--steps 6] [--skip-ray]

Two comparisons: a simulated GPU cluster (the stage's own scheduler of asynchronous steps,
`rl.pipelined.run_pipelined`, driving a stand-in runtime in scaled wall time) and the Ray runtime on this
machine (`run_rl_stage` at `rl.max_staleness` = 0, 1, 2, the same batches and seeds). Invariant: no batch
is older than the bound (`stale_dropped` counts violations and must be 0).
See docs/benchmarks-training.md, "bench/async_rl.py".
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from runtime import RAY, ParityGrader, base_checkpoint  # bench/runtime.py (bench/ is on the path above)


# ------------------------------------------------------------------------------------------- simulation
class _SimRuntime:
    """The runtime the simulated steps run on: only `sync_weights` (a push of `seconds`) is used."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def sync_weights(self, checkpoint_url=None):
        from rstar2_core.runtime.protocol import WeightSyncReport

        time.sleep(self.seconds)
        return WeightSyncReport("simulated", 1, self.seconds, (self.seconds,))


def simulated_phases(args) -> tuple[list[float], list[float]]:
    """(rollout seconds, generated tokens) per step: bench/scheduler.py's workload at GPU-like costs on 8
    engines, through its KV-aware policy warmed on the previous step."""
    from engine_sim import simulate, workload
    from scheduler import GPU_LIKE, parse_cost, policies

    shape = SimpleNamespace(engines=8, max_len=12288)
    cost, capacity = parse_cost(GPU_LIKE), int(24 * (300 + shape.max_len))
    n = shape.engines * args.sim_per_engine
    rollout_s, tokens = [], []
    for step in range(args.steps):
        prev = workload(n, 5000, shape.max_len, 300, 10_000 + step, 32, 0.25)
        trajs = workload(n, 5000, shape.max_len, 300, step, 32, 0.25)
        res = simulate(trajs, policies(shape, capacity, prev)["kv_aware"], shape.engines, capacity, cost)
        rollout_s.append(res.makespan_s)
        tokens.append(sum(t.response_tokens for t in trajs))
    return rollout_s, tokens


def simulate_arms(args) -> dict:
    from rstar2_core.rl.pipelined import StepPlan, run_pipelined
    from rstar2_core.rl.step import Grades, RolledOut, StepOutcome
    from rstar2_core.runtime.protocol import RuntimeUsage

    rollout_s, tokens = simulated_phases(args)
    mean_r, mean_tok = statistics.fmean(rollout_s), statistics.fmean(tokens)
    train_s = [args.train_ratio * mean_r * t / mean_tok for t in tokens]
    scale = args.sim_scale
    plans = [StepPlan(s + 1, (), 0) for s in range(args.steps)]
    usage = RuntimeUsage()

    async def rollout(plan, version):
        await asyncio.sleep(rollout_s[plan.step - 1] * scale)
        return RolledOut((), [], Grades([], []), {}, rollout_s[plan.step - 1], 0.0, usage, usage, version)

    def update(plan, rolled, staleness):
        time.sleep(train_s[plan.step - 1] * scale)
        return StepOutcome({"rollout/staleness": float(staleness)}, True)

    async def nothing(plan):
        return None

    def run(k: int) -> tuple[float, list[float]]:
        """Seconds per step (median interval between consecutive steps' ends, in simulated seconds: the
        pipeline's steady state) and each step's staleness."""
        ends: list[float] = []
        stale: list[float] = []

        def done(plan, outcome):
            ends.append(time.perf_counter())
            stale.append(outcome.metrics["rollout/staleness"])

        if k == 0:                       # rl_step's order: rollout, update, push
            for s in range(args.steps):
                time.sleep((rollout_s[s] + train_s[s] + args.sync_s) * scale)
                done(None, StepOutcome({"rollout/staleness": 0.0}, True))
        else:
            asyncio.run(run_pipelined(_SimRuntime(args.sync_s * scale), plans, max_staleness=k, start_version=0,
                                      rollout=rollout, update=update, before_step=nothing, after_step=done))
        return statistics.median(b - a for a, b in itertools.pairwise(ends)) / scale, stale

    sync, _ = run(0)
    k1, stale1 = run(1)
    k2, stale2 = run(2)
    over = sum(1 for x in stale1 if x > 1) + sum(1 for x in stale2 if x > 2)
    return {"sim_ratio_k1": round(sync / k1, 3), "sim_ratio_k2": round(sync / k2, 3), "sim_over_bound": over,
            "sim": {"step_s_sync": round(sync, 1), "step_s_k1": round(k1, 1), "step_s_k2": round(k2, 1),
                    "rollout_s_mean": round(mean_r, 1), "rollout_s_min": round(min(rollout_s), 1),
                    "rollout_s_max": round(max(rollout_s), 1), "train_s_mean": round(statistics.fmean(train_s), 1),
                    "sync_s": args.sync_s, "engines": 8, "trajectories_per_step": 8 * args.sim_per_engine,
                    "mean_staleness_k1": round(statistics.fmean(stale1), 3),
                    "mean_staleness_k2": round(statistics.fmean(stale2), 3), "scale": scale}}


# ------------------------------------------------------------------------------------------- measured
class _ParityGraderPool(ParityGrader):
    """bench/runtime.py's timing-only reward as a `GraderPool` (a context manager), for the stage's own
    grader slot."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def ray_arm(k: int, args, url: str, data_url: str, work: Path) -> dict:
    from rstar2_core.config import load_config
    from rstar2_core.rl.stage import run_rl_stage

    overrides = RAY + ["rollout.num_engines=2", "cluster.trainer_ranks=2", f"rl.prompts_per_step={args.prompts}",
                       "rl.grpo.group_size=4", "rl.grpo.oversample=2",
                       "rl.warmup_steps=0", "rl.lr=1e-3", "rl.micro_batch_size=16", f"rl.stages.0.steps={args.steps}",
                       f"rl.stages.0.max_response_tokens={args.tokens}", "rl.stages.0.max_turns=2",
                       f"rollout.max_batch_size={args.prompts * 8}", "rl.checkpoint_every=1", "rl.keep_checkpoints=1",
                       f"cluster.cpus_per_node={max(2, os.cpu_count() or 2)}", f"rl.max_staleness={k}"]
    if k:
        overrides.append("rl.tis_cap=2.0")
    cfg = load_config("tiny", overrides)
    marks: list[tuple[float, dict]] = []
    t0 = time.perf_counter()

    def record(metrics, step):
        marks.append((time.perf_counter(), metrics))
        print(f"  k={k} step {step}/{args.steps}: staleness {metrics.get('rollout/staleness', 0):.0f}, "
              f"updated {not metrics.get('actor/skipped')} [{time.perf_counter() - t0:.0f} s]",
              file=sys.stderr, flush=True)

    run_rl_stage(cfg, 0, init_checkpoint_url=url, data_url=data_url, out_url=(work / f"k{k}").as_uri(),
                 log_metrics=record, resume=False)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    stale = [m.get("rollout/staleness", 0.0) for _, m in marks]
    return {"step_s": round(statistics.median(gaps), 3), "over_bound": sum(1 for x in stale if x > k),
            "mean_staleness": round(statistics.fmean(stale), 3),
            "updated_steps": sum(1 for _, m in marks if not m.get("actor/skipped")), "wall_s": round(time.perf_counter() - t0, 1)}


def measure_ray(args) -> dict:
    from rstar2_core import reward
    from rstar2_core.config import load_config
    from rstar2_core.data.synthetic import generate_problems

    url = base_checkpoint(load_config("tiny"))
    reward.GraderPool = _ParityGraderPool           # the stage opens its grader through this name
    with tempfile.TemporaryDirectory(prefix="rstar2-async-bench-") as d:
        work = Path(d)
        rows = [{"id": p.id, "problem": p.problem, "answer": p.answer}
                for p in generate_problems(0, args.steps * args.prompts, "rl")]
        (work / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data_url = (work / "rl.jsonl").as_uri()
        arms = {name: ray_arm(k, args, url, data_url, work) for name, k in (("sync", 0), ("async1", 1), ("async2", 2))}
    from rstar2_core.runtime.ray.connect import disconnect_ray

    disconnect_ray()    # flushes the actors' forwarded logs now, so that the JSON line stays the last one
    return arms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 steps, a smaller simulated batch")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step of the Ray arms")
    ap.add_argument("--tokens", type=int, default=96, help="response tokens of the Ray arms")
    ap.add_argument("--sim-per-engine", type=int, default=64, help="simulated trajectories per engine per step")
    ap.add_argument("--train-ratio", type=float, default=1.0, help="simulated update / mean rollout seconds")
    ap.add_argument("--sync-s", type=float, default=3.0, help="simulated weight push seconds")
    ap.add_argument("--sim-scale", type=float, default=0.005, help="wall seconds per simulated second")
    ap.add_argument("--skip-ray", action="store_true", help="the simulation only")
    ap.add_argument("--learning", action="store_true",
                    help="also run bench/learning.py --async-k 1 in full (SFT, then RoC synchronous, GRPO and RoC with k = 1; "
                         "~7 min on 2 cores; --quick does not shorten it): keys pass1_sync, pass1_k1")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.sim_per_engine = 4, 32
    os.environ.setdefault("RSTAR2_HOME", str(ROOT / ".rstar2"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    torch.set_num_threads(1)
    load0, t0 = os.getloadavg(), time.time()
    print("[async bench] simulated GPU cluster ...", file=sys.stderr, flush=True)
    out: dict = simulate_arms(args)
    print(f"[async bench] simulation: sync {out['sim']['step_s_sync']} s/step, k=1 {out['sim']['step_s_k1']}, "
          f"k=2 {out['sim']['step_s_k2']} (x{out['sim_ratio_k1']}, x{out['sim_ratio_k2']}) "
          f"[{time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    if not args.skip_ray:
        print("[async bench] Ray runtime on this machine, k = 0, 1, 2 ...", file=sys.stderr, flush=True)
        arms = measure_ray(args)
        out.update({name: arm for name, arm in arms.items()})
        out["ratio_k1"] = round(arms["sync"]["step_s"] / arms["async1"]["step_s"], 3)
        out["ratio_k2"] = round(arms["sync"]["step_s"] / arms["async2"]["step_s"], 3)
        out["mean_staleness"] = {"k1": arms["async1"]["mean_staleness"], "k2": arms["async2"]["mean_staleness"]}
    if args.learning:
        print("[async bench] learning: bench/learning.py --async-k 1 ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--async-k", "1", "--json"],
                              stdout=subprocess.PIPE, text=True, check=True)
        learned = json.loads(proc.stdout.strip().splitlines()[-1])
        out.update({"pass1_sft": learned["sft_pass1"], "pass1_sync": learned["rl_pass1"],
                    "pass1_k1": learned["async_pass1"], "pass1_grpo": learned["grpo_pass1"],
                    "pos_tool_error_ratio": {"sync": learned["roc_pos_tool_error_ratio"],
                                             "k1": learned["async_pos_tool_error_ratio"],
                                             "grpo": learned["grpo_pos_tool_error_ratio"]},
                    "learning_targets": learned["targets"], "learning_plot": learned["plot"]})
    out["stale_dropped"] = out["sim_over_bound"] + sum(out.get(a, {}).get("over_bound", 0) for a in ("async1", "async2"))
    out.update({"steps": args.steps, "quick": args.quick, "cpus": os.cpu_count(),
                "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
                "wall_s": round(time.time() - t0, 1)})
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
