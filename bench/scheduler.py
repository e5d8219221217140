"""Benchmark: discrete-event simulation of rollout scheduling on 8 engines, static vs KV-cache-aware.

The workload is the paper's regime scaled to a simulation: GRPO groups (`--group-size` 32 samples per
problem: RoC's 2G oversampling), 256 trajectories per engine (the paper: 512 prompts x 32 rollouts on
64 GPUs), a long-tailed response length (lognormal, mean ~`--mean-len` tokens, capped at `--max-len`,
the stage's max response length), several turns each, a tool wait between turns (lognormal, mean
0.3 s: the paper's mean tool latency) and tool-response tokens appended after each call.

Lengths within a group are correlated: `--problem-share` of the log-length variance comes from the
problem (a hard problem makes all its samples long). The default 0.25 is set so that static
allocation's per-engine token loads spread like those reported on verl (max/min ~1.5 across rollout
workers: 42.8K vs 28.0K tokens, verl issue #658; "~30%" in the same thread); with 0 the lengths are
independent and static's chunks are nearly balanced. Every figure is the median over `--seeds`
workloads (5), because which engine draws the hard groups moves the result by +-0.1x.

Tool calls are dispatched asynchronously in both modes, so the comparison isolates *where and when
trajectories are admitted*:

- `static`: the problem-major batch is cut into one contiguous chunk per engine
  (`rstar2_core.rollout.scheduler.static_assignment`, as verl splits its repeated batch across rollout
  workers) and all of it launched at once. Each engine behaves like vLLM: it admits waiting sequences
  while their current tokens fit its KV cache, and when decoding outgrows the cache it preempts the
  most recently admitted sequence (recompute mode: its KV is dropped and its whole current length is
  prefilled again on re-admission: `recomputed_tokens`).
- `kv_aware` (ours, `rstar2_core.rollout.scheduler`): one global queue; an engine admits a trajectory
  only while prompt + max response length of everything it holds fits its KV capacity, and the
  moment a trajectory finishes, the next queued one goes to the engine with the most free capacity.
  Nothing is ever preempted.

Costs are calibrated from a real HFEngine measurement on this machine (tiny model, `--quick`: smaller):
the decode-step time is fitted as `t = a + b * batch + c * kv_tokens` (least squares over decode
steps at several batch sizes and lengths), and prefill costs `p` per token. Absolute times are
therefore "seconds of that engine"; the ratio is what carries over. KV capacity per engine defaults
to 24 full-length sequences (`--capacity-seqs`).

Run:  python bench/scheduler.py [--quick] [--json] [--cost a_ms,b_ms,c_us,p_ms] [--per-engine N]
      [--problem-share S] [--seeds N]
`--json` prints one JSON object as the last line: `static_makespan_s`, `kv_aware_makespan_s`,
`ratio` (= static / kv_aware; medians over the workloads, with `ratio_min`/`ratio_max`),
`recomputed_tokens` (kv_aware, summed over all workloads; 0 by construction and counted),
`static_recomputed_tokens`, `static_engine_tokens_max_over_min`, per-workload `runs`, the calibration
and the workload.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rstar2_core.rollout.scheduler import static_assignment


@dataclass
class Cost:
    a: float      # s per decode step (fixed part)
    b: float      # s per sequence in the batch
    c: float      # s per KV token attended
    p: float      # s per prefilled token

    def steps(self, k: int, batch: int, kv0: int) -> float:
        """Time of k decode steps of `batch` sequences starting at kv0 resident tokens (kv grows by batch/step)."""
        return k * (self.a + self.b * batch + self.c * kv0) + self.c * batch * k * (k - 1) / 2


@dataclass
class Traj:
    id: int
    prompt: int
    turns: list[int]          # sampled tokens per turn
    tools: list[float]        # tool wait after each turn but the last (s)
    tool_tokens: int
    turn: int = 0
    left: int = 0             # tokens left in the current turn
    length: int = 0           # resident tokens (prompt + response so far)
    ready_at: float = 0.0
    admitted_seq: int = 0


def workload(n: int, mean_len: float, max_len: int, prompt: int, seed: int, group_size: int = 1,
             problem_share: float = 0.0) -> list[Traj]:
    """n trajectories in problem-major order (group_size consecutive ones share a problem).

    Response length is lognormal (sigma 1, mean `mean_len`, capped at `max_len`); `problem_share` of its
    log-variance comes from the problem (hard problems make every sample of the group long), the rest
    is per sample. 0 gives independent lengths.
    """
    if not 0.0 <= problem_share <= 1.0:
        raise ValueError(f"problem_share must be in [0, 1], got {problem_share}")
    rng = random.Random(seed)
    sigma = 1.0
    mu = math.log(mean_len) - sigma ** 2 / 2
    out = []
    z_problem = 0.0
    for i in range(n):
        if i % group_size == 0:
            z_problem = rng.gauss(0.0, 1.0)
        z = math.sqrt(problem_share) * z_problem + math.sqrt(1.0 - problem_share) * rng.gauss(0.0, 1.0)
        total = max(64, min(max_len, int(math.exp(mu + sigma * z))))
        k = max(1, min(10, 1 + int(rng.expovariate(1 / 2.5))))          # assistant turns, 1..10
        tool_tokens = 120
        sampled = max(k, total - (k - 1) * tool_tokens)
        cuts = sorted(rng.sample(range(1, sampled), k - 1)) if k > 1 and sampled > k else []
        turns = [b - a for a, b in zip([0, *cuts], [*cuts, sampled])] or [sampled]
        turns = [max(1, t) for t in turns]
        tools = [rng.lognormvariate(math.log(0.3) - 0.5 ** 2 / 2, 0.5) for _ in turns[:-1]]
        out.append(Traj(i, prompt, turns, tools, tool_tokens))
    return out


@dataclass
class Engine:
    capacity: int
    max_seqs: int
    t: float = 0.0
    running: list[Traj] = field(default_factory=list)    # decoding now, in admission order
    waiting_tool: list[Traj] = field(default_factory=list)
    queue: list[Traj] = field(default_factory=list)      # static: this engine's share, not yet resident
    reserved: int = 0
    recomputed: int = 0
    seq: int = 0

    def used(self) -> int:
        return sum(t.length for t in self.running) + sum(t.length for t in self.waiting_tool)


def simulate(trajs: list[Traj], engines: int, capacity: int, max_len: int, cost: Cost, mode: str,
             max_seqs: int = 256) -> dict:
    """Run the simulation; returns makespan and recomputed tokens."""
    import copy
    trajs = copy.deepcopy(trajs)
    es = [Engine(capacity, max_seqs) for _ in range(engines)]
    global_q = list(reversed(trajs))
    reserve = lambda tr: tr.prompt + max_len
    if mode == "static":
        for tr, k in zip(trajs, static_assignment(len(trajs), engines)):
            es[k].queue.append(tr)

    def start(e: Engine, tr: Traj, recompute: bool) -> None:
        prefill = tr.length if recompute else tr.prompt
        if recompute:
            e.recomputed += tr.length
        else:
            tr.length, tr.left = tr.prompt, tr.turns[0]
        e.t += cost.p * prefill
        e.seq += 1
        tr.admitted_seq = e.seq
        e.running.append(tr)

    def admit(e: Engine) -> None:
        if mode == "static":
            while e.queue and len(e.running) + len(e.waiting_tool) < e.max_seqs:
                tr = e.queue[0]
                need = tr.length if tr.length else tr.prompt
                if e.used() + need > e.capacity:
                    return
                e.queue.pop(0)
                start(e, tr, recompute=tr.length > 0)
        else:
            while global_q and e.reserved + reserve(global_q[-1]) <= e.capacity and \
                    len(e.running) + len(e.waiting_tool) < e.max_seqs:
                tr = global_q.pop()
                e.reserved += reserve(tr)
                start(e, tr, recompute=False)

    def refill_all() -> None:
        if mode == "kv_aware":   # the engine with the most free capacity first
            for e in sorted(es, key=lambda e: e.reserved - e.capacity):
                admit(e)
        else:
            for e in es:
                admit(e)

    refill_all()
    finished = 0
    heap = [(e.t, i) for i, e in enumerate(es)]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        e = es[i]
        # tools that have returned rejoin the batch (their tool tokens are prefilled)
        for tr in [w for w in e.waiting_tool if w.ready_at <= e.t]:
            e.waiting_tool.remove(tr)
            tr.length += tr.tool_tokens
            e.t += cost.p * tr.tool_tokens
            e.running.append(tr)
        if mode == "static":
            while e.running and e.used() > e.capacity:      # over capacity: preempt the newest
                victim = max(e.running, key=lambda t: t.admitted_seq)
                e.running.remove(victim)
                e.queue.insert(0, victim)
        if not e.running:
            if e.waiting_tool:
                e.t = max(e.t, min(w.ready_at for w in e.waiting_tool))
                heapq.heappush(heap, (e.t, i))
            elif e.queue or (mode == "kv_aware" and global_q and e.reserved == 0):
                admit(e)
                if e.running:
                    heapq.heappush(heap, (e.t, i))
            continue
        batch = len(e.running)
        kv0 = sum(t.length for t in e.running)      # attention reads the decoding sequences' KV only
        k = min(tr.left for tr in e.running)
        if mode == "static":
            k = max(1, min(k, (e.capacity - e.used()) // batch))
        nxt = min((w.ready_at for w in e.waiting_tool), default=math.inf)
        if e.t + cost.steps(k, batch, kv0) > nxt:            # stop at the next tool return
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if e.t + cost.steps(mid, batch, kv0) <= nxt:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        e.t += cost.steps(k, batch, kv0)
        for tr in list(e.running):
            tr.left -= k
            tr.length += k
            if tr.left == 0:
                e.running.remove(tr)
                tr.turn += 1
                if tr.turn == len(tr.turns):
                    finished += 1
                    if mode == "kv_aware":
                        e.reserved -= reserve(tr)
                else:
                    tr.left = tr.turns[tr.turn]
                    tr.ready_at = e.t + tr.tools[tr.turn - 1]
                    e.waiting_tool.append(tr)
        admit(e)        # kv_aware: capacity freed on e goes to the next queued trajectory, on e
        heapq.heappush(heap, (e.t, i))
    assert finished == len(trajs), f"simulation lost trajectories ({finished}/{len(trajs)})"
    return {"makespan_s": max(e.t for e in es), "recomputed_tokens": sum(e.recomputed for e in es),
            "engine_busy_until": [round(e.t, 2) for e in es]}


def calibrate(quick: bool) -> tuple[Cost, dict]:
    """Fit decode-step and prefill costs on a real HFEngine (tiny model) on this machine."""
    import numpy as np
    import torch
    from rollout import tiny_setup

    from rstar2_core.rollout import HFEngine, SamplingParams

    model, tok, _ = tiny_setup()
    rows, times = [], []
    prefill = []
    lengths = (64, 512) if quick else (64, 512, 1536)
    for batch in ((1, 8) if quick else (1, 8, 32)):
        for start in lengths:
            eng = HFEngine(model, tok, max_batch_size=batch, max_seq_len=start + 80)

            async def go(eng=eng, batch=batch, start=start):
                prompts = [[(7 * i + j) % 300 + 3 for j in range(start)] for i in range(batch)]
                await asyncio.gather(*(eng.generate(p, SamplingParams(max_new_tokens=48, temperature=1.0, seed=i))
                                       for i, p in enumerate(prompts)))
                await eng.close()
            asyncio.run(go())
            s = eng.stats
            steps = s["decode_steps"]
            rows.append([1.0, batch, batch * (start + 24)])
            times.append(s["decode_s"] / steps)
            prefill.append(s["prefill_s"] / s["prefill_tokens"])
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    a, b, c = (max(float(x), 0.0) for x in coef)
    cost = Cost(a=a, b=b, c=c, p=float(np.median(prefill)))
    info = {"decode_step_fit": {"a_ms": round(a * 1e3, 4), "b_ms_per_seq": round(b * 1e3, 5),
                                "c_us_per_kv_token": round(c * 1e6, 5)},
            "prefill_ms_per_token": round(cost.p * 1e3, 5), "calibration_points": len(rows),
            "torch_threads": torch.get_num_threads()}
    return cost, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cost", default=None,
                    help="a_ms,b_ms,c_us,p_ms: skip the calibration and use these costs (e.g. from an earlier --json)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--per-engine", type=int, default=256, help="trajectories per engine")
    ap.add_argument("--mean-len", type=float, default=5000)
    ap.add_argument("--max-len", type=int, default=12288)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--group-size", type=int, default=32,
                    help="samples per problem (the paper: 2G = 32 rollouts, 16 kept), consecutive in the batch")
    ap.add_argument("--problem-share", type=float, default=0.25,
                    help="share of the log-length variance that comes from the problem (0: independent lengths)")
    ap.add_argument("--capacity-seqs", type=float, default=24, help="KV capacity per engine, in full-length sequences")
    ap.add_argument("--seed", type=int, default=0, help="first workload seed")
    ap.add_argument("--seeds", type=int, default=5,
                    help="workloads simulated (seeds seed..seed+N-1); figures are medians, the ratio range is printed")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared, loaded machine 2 OpenMP threads run ~10x slower)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    if args.quick:
        args.per_engine = min(args.per_engine, 32)
        args.seeds = min(args.seeds, 2)
    t0 = time.perf_counter()
    if args.cost:
        a, b, c, p = (float(x) for x in args.cost.split(","))
        cost, info = Cost(a=a / 1e3, b=b / 1e3, c=c / 1e6, p=p / 1e3), {"calibration": f"given: {args.cost}"}
    else:
        print("[scheduler bench] calibrating on a real HFEngine ...", flush=True)
        cost, info = calibrate(args.quick)
        print(f"[scheduler bench] calibration {info}", flush=True)
    capacity = int(args.capacity_seqs * (args.prompt + args.max_len))
    runs = []
    for r in range(args.seeds):
        trajs = workload(args.engines * args.per_engine, args.mean_len, args.max_len, args.prompt, args.seed + r,
                         args.group_size, args.problem_share)
        res = {mode: simulate(trajs, args.engines, capacity, args.max_len, cost, mode)
               for mode in ("static", "kv_aware")}
        lens = [sum(t.turns) + (len(t.turns) - 1) * t.tool_tokens for t in trajs]
        per_engine = [0] * args.engines
        for n_tok, k in zip(lens, static_assignment(len(trajs), args.engines)):
            per_engine[k] += n_tok
        run = {"seed": args.seed + r,
               "static_makespan_s": round(res["static"]["makespan_s"], 2),
               "kv_aware_makespan_s": round(res["kv_aware"]["makespan_s"], 2),
               "ratio": round(res["static"]["makespan_s"] / res["kv_aware"]["makespan_s"], 3),
               "recomputed_tokens": res["kv_aware"]["recomputed_tokens"],
               "static_recomputed_tokens": res["static"]["recomputed_tokens"],
               "static_engine_tokens_max_over_min": round(max(per_engine) / min(per_engine), 3),
               "response_len_mean": round(sum(lens) / len(lens)), "response_len_max": max(lens),
               "turns_mean": round(sum(len(t.turns) for t in trajs) / len(trajs), 2)}
        runs.append(run)
        print(f"[scheduler bench] workload {r + 1}/{args.seeds} (seed {run['seed']}): static "
              f"{run['static_makespan_s']:.1f} s ({run['static_recomputed_tokens']} tokens recomputed, engines' "
              f"token loads max/min {run['static_engine_tokens_max_over_min']}), kv_aware "
              f"{run['kv_aware_makespan_s']:.1f} s ({run['recomputed_tokens']} recomputed): "
              f"ratio {run['ratio']}x  [{time.perf_counter() - t0:.0f} s]", flush=True)
    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 3)

    out = {
        "static_makespan_s": med("static_makespan_s"),
        "kv_aware_makespan_s": med("kv_aware_makespan_s"),
        "ratio": med("ratio"),
        "ratio_min": min(r["ratio"] for r in runs), "ratio_max": max(r["ratio"] for r in runs),
        "recomputed_tokens": sum(r["recomputed_tokens"] for r in runs),
        "static_recomputed_tokens": int(med("static_recomputed_tokens")),
        "static_engine_tokens_max_over_min": med("static_engine_tokens_max_over_min"),
        "engines": args.engines, "trajectories": args.engines * args.per_engine,
        "kv_capacity_tokens_per_engine": capacity,
        "response_len_mean": med("response_len_mean"), "turns_mean": med("turns_mean"),
        "group_size": args.group_size, "problem_share": args.problem_share, "workloads": args.seeds,
        "runs": runs,
        **info, "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    print(f"[scheduler bench] median over {args.seeds} workloads: static {out['static_makespan_s']} s vs kv_aware "
          f"{out['kv_aware_makespan_s']} s: ratio {out['ratio']}x (range {out['ratio_min']}-{out['ratio_max']}; "
          f"target >= 1.3), recomputed tokens static {out['static_recomputed_tokens']} (median), "
          f"kv_aware {out['recomputed_tokens']} (all workloads)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
