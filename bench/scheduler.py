"""Benchmark: rollout scheduling on 8 simulated engines, static vs KV-aware, through the core's policies.

Run:  python bench/scheduler.py [--quick] [--json] [--gpu-like | --cost a,b,c,p] [--capacity-seqs N] ...

Each workload (the paper's regime scaled: GRPO groups of 32, 256 trajectories per engine, long-tailed
lengths, 1-10 turns) is replayed by `bench/engine_sim.py` `simulate` under the policy objects
`rollout_groups` uses (`rstar2_core.rollout.admission`), so the figures measure that code; they are
medians over `--seeds` workloads (5). Costs fitted on a real HFEngine here, or GPU-like (`--gpu-like`).
See docs/benchmarks.md, "bench/scheduler.py" (arms, costs, keys), and docs/rollout-scheduling.md, "Benchmark".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_sim import Cost, simulate, workload

from rstar2_core.rollout.admission import KVAdmission, StaticAdmission, static_assignment
from rstar2_core.rollout.length_model import LengthModel

GPU_LIKE = "5,0.02,0.03,0.05"
PREVIOUS_STEP = 10_000      # seed offset of the workload that warms the length model


def calibrate(quick: bool) -> tuple[Cost, dict]:
    """Fit decode-step and prefill costs on a real HFEngine (tiny model) on this machine."""
    import numpy as np
    import torch
    from rollout import tiny_setup

    from rstar2_core.rollout import HFEngine, SamplingParams

    model, tok, _ = tiny_setup()
    rows, times, prefill = [], [], []
    lengths = (64, 512) if quick else (64, 512, 1536)
    points = [(b, s) for b in ((1, 8) if quick else (1, 8, 32)) for s in lengths]
    t0 = time.perf_counter()
    for n, (batch, start) in enumerate(points, 1):
        eng = HFEngine(model, tok, max_batch_size=batch, max_seq_len=start + 80)

        async def go(eng=eng, batch=batch, start=start):
            prompts = [[(7 * i + j) % 300 + 3 for j in range(start)] for i in range(batch)]
            await asyncio.gather(*(eng.generate(p, SamplingParams(max_new_tokens=48, temperature=1.0, seed=i))
                                   for i, p in enumerate(prompts)))
            await eng.close()
        asyncio.run(go())
        s = eng.stats
        rows.append([1.0, batch, batch * (start + 24)])
        times.append(s["decode_s"] / s["decode_steps"])
        prefill.append(s["prefill_s"] / s["prefill_tokens"])
        el = time.perf_counter() - t0
        print(f"[scheduler bench] calibration {n}/{len(points)} (batch {batch}, context {start}) "
              f"[{el:.0f} s, ETA {el / n * (len(points) - n):.0f} s]", flush=True)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    a, b, c = (max(float(x), 0.0) for x in coef)
    cost = Cost(a=a, b=b, c=c, p=float(np.median(prefill)))
    return cost, {"calibration": "HFEngine fit", "calibration_points": len(rows),
                  "torch_threads": torch.get_num_threads()}


def parse_cost(text: str) -> Cost:
    try:
        a, b, c, p = (float(x) for x in text.split(","))
    except ValueError as e:
        raise SystemExit(f"--cost needs four comma-separated numbers a_ms,b_ms,c_us,p_ms, got {text!r}") from e
    return Cost(a=a / 1e3, b=b / 1e3, c=c / 1e6, p=p / 1e3)


def policies(args, capacity: int, previous: list) -> dict:
    """The policies compared on one workload (fresh objects: policies keep state). `previous`: the
    previous step's trajectories, observed with their groups as `rollout_groups` would have."""
    warm = LengthModel(args.max_len)
    for t in previous:
        warm.observe(t.response_tokens, ("previous step", t.group))
    caps = [capacity] * args.engines
    return {
        "static": StaticAdmission(args.engines),
        "kv_aware": KVAdmission(caps, max_response_tokens=args.max_len, lengths=warm),
        "kv_aware_cold": KVAdmission(caps, max_response_tokens=args.max_len),
        "paper": KVAdmission(caps, max_response_tokens=args.max_len, reserve="max"),
        "group_affinity": KVAdmission(caps, max_response_tokens=args.max_len, lengths=warm, group_affinity=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 trajectories per engine, 2 workloads")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gpu-like", action="store_true", help=f"the GPU-like cost set (--cost {GPU_LIKE})")
    ap.add_argument("--cost", default=None, help="a_ms,b_ms,c_us,p_ms: skip the calibration, use these costs")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--per-engine", type=int, default=256, help="trajectories per engine")
    ap.add_argument("--mean-len", type=float, default=5000)
    ap.add_argument("--max-len", type=int, default=12288)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--group-size", type=int, default=32, help="samples per problem, consecutive in the batch")
    ap.add_argument("--problem-share", type=float, default=0.25,
                    help="share of the log-length variance that comes from the problem (0: independent lengths)")
    ap.add_argument("--capacity-seqs", type=float, default=24, help="KV capacity per engine, in full-length sequences")
    ap.add_argument("--seed", type=int, default=0, help="first workload seed")
    ap.add_argument("--seeds", type=int, default=5, help="workloads simulated; figures are medians")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the calibration (1: on a shared, loaded machine 2 ran ~10x slower)")
    args = ap.parse_args()
    if args.gpu_like and args.cost:
        raise SystemExit("--gpu-like and --cost both set the costs; pass one")
    if args.quick:
        args.per_engine, args.seeds = min(args.per_engine, 32), min(args.seeds, 2)
    t0 = time.perf_counter()
    if args.gpu_like or args.cost:
        text = GPU_LIKE if args.gpu_like else args.cost
        cost, info = parse_cost(text), {"calibration": "gpu-like" if args.gpu_like else "given", "cost_arg": text}
    else:
        import torch
        torch.set_num_threads(args.threads)
        print("[scheduler bench] calibrating on a real HFEngine ...", flush=True)
        cost, info = calibrate(args.quick)
    info["cost"] = {"a_ms": round(cost.a * 1e3, 5), "b_ms_per_seq": round(cost.b * 1e3, 6),
                    "c_us_per_kv_token": round(cost.c * 1e6, 6), "p_ms_per_prefill_token": round(cost.p * 1e3, 6)}
    print(f"[scheduler bench] costs {info['cost']}", flush=True)
    capacity = int(args.capacity_seqs * (args.prompt + args.max_len))
    n = args.engines * args.per_engine
    runs = []
    for r in range(args.seeds):
        seed = args.seed + r
        trajs = workload(n, args.mean_len, args.max_len, args.prompt, seed, args.group_size, args.problem_share)
        prev = workload(n, args.mean_len, args.max_len, args.prompt, seed + PREVIOUS_STEP, args.group_size,
                        args.problem_share)
        res = {name: simulate(trajs, pol, args.engines, capacity, cost)
               for name, pol in policies(args, capacity, prev).items()}
        load = [0] * args.engines
        for t, k in zip(trajs, static_assignment(n, args.engines)):
            load[k] += t.response_tokens
        st = res["static"].makespan_s
        run = {"seed": seed, "static_makespan_s": round(st, 2),
               "static_recomputed_tokens": res["static"].recomputed_tokens,
               "static_engine_tokens_max_over_min": round(max(load) / min(load), 3),
               "response_len_mean": round(sum(t.response_tokens for t in trajs) / n)}
        for name in ("kv_aware", "kv_aware_cold", "paper", "group_affinity"):
            x = res[name]
            run.update({f"{name}_makespan_s": round(x.makespan_s, 2), f"{name}_ratio": round(st / x.makespan_s, 3),
                        f"{name}_recomputed_tokens": x.recomputed_tokens, f"{name}_holds": x.holds,
                        f"{name}_mean_batch": round(x.mean_batch, 1)})
        run["static_mean_batch"] = round(res["static"].mean_batch, 1)
        runs.append(run)
        el = time.perf_counter() - t0
        print(f"[scheduler bench] workload {r + 1}/{args.seeds} (seed {seed}): static {st:.1f} s "
              f"({run['static_recomputed_tokens']} recomputed), kv_aware {run['kv_aware_makespan_s']} s "
              f"({run['kv_aware_recomputed_tokens']} recomputed, {run['kv_aware_holds']} holds): "
              f"{run['kv_aware_ratio']}x; cold {run['kv_aware_cold_ratio']}x, paper {run['paper_ratio']}x, "
              f"group affinity {run['group_affinity_ratio']}x  [{el:.0f} s, ETA {el / (r + 1) * (args.seeds - r - 1):.0f} s]",
              flush=True)

    def med(key: str) -> float:
        return round(statistics.median(x[key] for x in runs), 3)

    out = {
        "static_makespan_s": med("static_makespan_s"), "kv_aware_makespan_s": med("kv_aware_makespan_s"),
        "ratio": med("kv_aware_ratio"), "ratio_min": min(x["kv_aware_ratio"] for x in runs),
        "ratio_max": max(x["kv_aware_ratio"] for x in runs),
        "recomputed_tokens": sum(x["kv_aware_recomputed_tokens"] for x in runs),
        "holds": sum(x["kv_aware_holds"] for x in runs),
        "static_recomputed_tokens": int(med("static_recomputed_tokens")),
        "cold_ratio": med("kv_aware_cold_ratio"),
        "cold_recomputed_tokens": sum(x["kv_aware_cold_recomputed_tokens"] for x in runs),
        "paper_ratio": med("paper_ratio"), "paper_recomputed_tokens": sum(x["paper_recomputed_tokens"] for x in runs),
        "group_affinity_ratio": med("group_affinity_ratio"),
        "group_affinity_recomputed_tokens": sum(x["group_affinity_recomputed_tokens"] for x in runs),
        "static_engine_tokens_max_over_min": med("static_engine_tokens_max_over_min"),
        "static_mean_batch": med("static_mean_batch"), "kv_aware_mean_batch": med("kv_aware_mean_batch"),
        "engines": args.engines, "trajectories": n, "kv_capacity_tokens_per_engine": capacity,
        "capacity_seqs": args.capacity_seqs, "response_len_mean": med("response_len_mean"),
        "group_size": args.group_size, "problem_share": args.problem_share, "workloads": args.seeds,
        "runs": runs, **info, "wall_s": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    print(f"[scheduler bench] median over {args.seeds} workloads: static {out['static_makespan_s']} s vs kv_aware "
          f"{out['kv_aware_makespan_s']} s: ratio {out['ratio']}x (range {out['ratio_min']}-{out['ratio_max']}), "
          f"recomputed tokens kv_aware {out['recomputed_tokens']} (all workloads), static "
          f"{out['static_recomputed_tokens']} (median); cold {out['cold_ratio']}x, paper rule {out['paper_ratio']}x, "
          f"group affinity {out['group_affinity_ratio']}x")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
