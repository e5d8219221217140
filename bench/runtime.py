"""Benchmark: the same RL steps on the local runtime and on the Ray runtime, side by side in one run.

    .venv/bin/python bench/runtime.py [--quick] [--json] [--steps 4] [--prompts 4] [--engines 2] [--trainers 2]

Both arms run `rl.step.rl_step` on the tiny profile's from-scratch model from the same checkpoint, seeds
and batches, with a timing-only reward (`ParityGrader`) so that every step updates and syncs; the JSON
has each arm's seconds per step, the weight sync's seconds and bytes, and the largest relative
difference of pg_loss and grad-norm between the arms. See docs/benchmarks-training.md, "bench/runtime.py".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

RAY = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"',
       "rl.zero_stage=2"]


def arm_config(args, ray: bool):
    from rstar2_core.config import load_config

    base = [f"rl.prompts_per_step={args.prompts}", f"rl.grpo.group_size={args.group}", "rl.grpo.oversample=2",
            "rl.warmup_steps=0", "rl.lr=1e-3", f"rl.micro_batch_size={args.micro_batch}",
            f"rollout.max_batch_size={args.prompts * args.group * 2}"]
    if ray:
        base += RAY + [f"rollout.num_engines={args.engines}", f"cluster.trainer_ranks={args.trainers}",
                       f"cluster.cpus_per_node={max(2, os.cpu_count() or 2)}"]
    return load_config("tiny", base)


def base_checkpoint(cfg) -> str:
    from rstar2_core import storage
    from rstar2_core.models import prepare_base_model

    url = (Path(os.environ["RSTAR2_HOME"]) / "bench" / "runtime" / "base").resolve().as_uri()
    return url if storage.is_complete(url) else prepare_base_model(cfg, url)


class ParityGrader:
    """`grade_many` with the timing-only reward above (the runtime's grader slot)."""

    def grade_many(self, items):
        from rstar2_core.reward.grade import GradeResult

        out = []
        for text, _gold in items:
            ok = len(text) % 2 == 0
            out.append(GradeResult(1.0 if ok else 0.0, None, "correct" if ok else "wrong"))
        return out


def run_arm(cfg, url: str, problems, args, label: str) -> dict:
    from rstar2_core.chat import ChatFormat
    from rstar2_core.models.io import load_tokenizer
    from rstar2_core.rl.stage import engine_seq_len, step_seed
    from rstar2_core.rl.step import rl_step
    from rstar2_core.rl.trainer import RL_STEP
    from rstar2_core.rollout.types import RolloutLimits
    from rstar2_core.runtime import TrainerSpec, open_runtime

    chat = ChatFormat(load_tokenizer(url), with_tools=True)
    pad = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else chat.tokenizer.eos_token_id
    limits = RolloutLimits(max_turns=2, max_response_tokens=args.tokens, temperature=1.0)
    steps: list[dict] = []

    async def loop() -> float:
        t0 = time.perf_counter()
        async with open_runtime(cfg, policy_url=url, max_model_len=engine_seq_len(chat, problems, args.tokens),
                                grader=False, trainer=TrainerSpec("rl", args.steps, 0, "constant", RL_STEP)) as rt:
            start = time.perf_counter() - t0
            rt.grader = ParityGrader()
            for step in range(args.steps):
                batch = problems[step * args.prompts:(step + 1) * args.prompts]
                out = await rl_step(rt, chat, batch, rl=cfg.rl, rollout=cfg.rollout, limits=limits,
                                    seed=step_seed(0, step + 1), pad_id=pad)
                steps.append(out.metrics)
                print(f"  {label} step {step + 1}/{args.steps}: {out.metrics['timing/step_s']:.2f} s "
                      f"(rollout {out.metrics['timing/rollout_s']:.2f}, train {out.metrics['timing/train_s']:.2f}, "
                      f"sync {out.metrics['timing/sync_s']:.3f}), updated {not out.metrics.get('actor/skipped')}",
                      file=sys.stderr, flush=True)
        return start

    start = asyncio.run(loop())
    tail = steps[1:] if len(steps) > 1 else steps
    med = lambda key: statistics.median(m.get(key, 0.0) for m in tail)
    return {"step_s": round(med("timing/step_s"), 3), "start_s": round(start, 1),
            "rollout_tokens_per_s": round(sum(m["usage/tokens_generated"] for m in tail)
                                          / max(1e-9, sum(m["timing/rollout_s"] for m in tail)), 1),
            "train_s": round(med("timing/train_s"), 3), "sync_s": round(med("timing/sync_s"), 4),
            "sync_bytes": int(med("sync/bytes")), "engine_idle_frac": round(med("usage/engine_idle_frac"), 3),
            "trainer_idle_frac": round(med("usage/trainer_idle_frac"), 3), "steps": steps}


def parity(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        for k in ("actor/pg_loss", "actor/grad_norm"):
            if k in x and k in y:
                worst = max(worst, abs(x[k] - y[k]) / max(abs(x[k]), 1e-12))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps of 2 prompts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--trainers", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts = 3, 2
    os.environ.setdefault("RSTAR2_HOME", str(ROOT / ".rstar2"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    torch.set_num_threads(1)
    from rstar2_core.data.synthetic import generate_problems
    from rstar2_core.rl.data import RLProblem

    load0 = os.getloadavg()
    t0 = time.time()
    local_cfg, ray_cfg = arm_config(args, False), arm_config(args, True)
    url = base_checkpoint(local_cfg)
    problems = [RLProblem(p.id, p.problem, p.answer) for p in generate_problems(0, args.steps * args.prompts, "rl")]
    local = run_arm(local_cfg, url, problems, args, "local")
    ray_arm = run_arm(ray_cfg, url, problems, args, "ray")
    r = {"local": {k: v for k, v in local.items() if k != "steps"},
         "ray": {**{k: v for k, v in ray_arm.items() if k != "steps"}, "engines": args.engines,
                 "trainers": args.trainers},
         "parity_max_rel_diff": parity(local["steps"], ray_arm["steps"]),
         "updated_steps": sum(1 for m in ray_arm["steps"] if not m.get("actor/skipped")),
         "sync_s": ray_arm["sync_s"], "sync_bytes": ray_arm["sync_bytes"],
         "ratio": round(ray_arm["step_s"] / max(1e-9, local["step_s"]), 3),
         "prompts_per_step": args.prompts, "group_size": args.group, "oversample": 2, "max_tokens": args.tokens,
         "steps": args.steps, "quick": args.quick, "cpus": os.cpu_count(),
         "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
         "wall_s": round(time.time() - t0, 1)}
    print(f"local {r['local']['step_s']} s/step, {r['local']['rollout_tokens_per_s']} tok/s | ray "
          f"({args.engines} engines, {args.trainers} ranks) {r['ray']['step_s']} s/step, "
          f"{r['ray']['rollout_tokens_per_s']} tok/s, start {r['ray']['start_s']} s, sync {r['sync_s']} s / "
          f"{r['sync_bytes']} B | parity {r['parity_max_rel_diff']:.2e}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
