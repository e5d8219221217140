"""Peer comparison: seconds per RL step, TRL's `GRPOTrainer` vs our RL step, same work, same run.

    .venv/bin/python bench/vs_trl.py [--quick] [--json] [--model URL] [--prompts 8] [--group 8] [--tokens 64]

Both sides get the same tiny model, prompts, group size, prompts per step, max new tokens, sampling, lr,
clip, one optimizer step per RL step and the same timing-only reward (single-turn: no tool execution).
Ours = `rl.step.rl_step` on the local runtime; TRL = its `training_step`. Key `ratio` = ours / TRL
(target <= 0.7). See docs/benchmarks-training.md, "bench/vs_trl.py".
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timing_reward(text: str, gold: str) -> float:
    return 1.0 if gold.strip()[-1:] and gold.strip()[-1] in text else 0.0


def get_model(cfg, url: str | None):
    from rstar2_core import storage
    from rstar2_core.models import load_model_and_tokenizer, prepare_base_model

    if url is None:
        base = (Path(os.environ["RSTAR2_HOME"]) / "bench" / "vs_trl" / "base").resolve().as_uri()
        url = base if storage.is_complete(base) else prepare_base_model(cfg, base)
    model, tok = load_model_and_tokenizer(url)
    return model, tok, url


class TimingGrader:
    """`grade_many` with the timing-only reward above (the runtime's grader slot)."""

    def grade_many(self, items):
        from rstar2_core.reward.grade import GradeResult

        return [GradeResult(timing_reward(text, gold), None, "correct" if timing_reward(text, gold) else "wrong")
                for text, gold in items]


def ours_config(args):
    """The tiny profile set to this comparison's work: plain GRPO, G, P, micro-batch, one engine batch."""
    from rstar2_core.config import load_config

    return load_config("tiny", [f"rl.grpo.group_size={args.group}", "rl.grpo.oversample=1", 'rl.grpo.resample="none"',
                                f"rl.prompts_per_step={args.prompts}", f"rl.micro_batch_size={args.micro_batch}",
                                "rl.warmup_steps=0", f"rollout.max_batch_size={args.prompts * args.group}"])


def run_ours(cfg, url, tok, problems, args) -> list[float]:
    """Our RL steps: `rl.step.rl_step` on the local runtime (the code the RL stage runs)."""
    from rstar2_core.chat import ChatFormat
    from rstar2_core.rl.step import rl_step
    from rstar2_core.rl.trainer import RL_STEP
    from rstar2_core.rollout.types import RolloutLimits
    from rstar2_core.runtime import TrainerSpec, open_runtime

    cfg = ours_config(args)
    chat = ChatFormat(tok, with_tools=True)
    seq = max(len(chat.prompt_ids(p.problem)) for p in problems) + args.tokens + 1
    limits = RolloutLimits(max_turns=1, max_response_tokens=args.tokens, temperature=1.0)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    times: list[float] = []

    async def loop():
        async with open_runtime(cfg, policy_url=url, max_model_len=seq, grader=False,
                                trainer=TrainerSpec("rl", args.steps, 0, "constant", RL_STEP)) as rt:
            rt.grader = TimingGrader()
            for step in range(args.steps):
                batch = problems[step * args.prompts:(step + 1) * args.prompts]
                t0 = time.perf_counter()
                out = await rl_step(rt, chat, batch, rl=cfg.rl, rollout=cfg.rollout, limits=limits, seed=1000 + step,
                                    pad_id=pad)
                times.append(time.perf_counter() - t0)
                print(f"  ours step {step + 1}/{args.steps}: {times[-1]:.2f} s, kept "
                      f"{out.metrics['rollout/trajectories_kept']:.0f} of {out.metrics['rollout/trajectories']:.0f}",
                      file=sys.stderr, flush=True)

    asyncio.run(loop())
    return times


def run_trl(cfg, model, tok, problems, args) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rstar2_core.chat import ChatFormat

    chat = ChatFormat(tok, with_tools=True)
    gold = {chat.prompt_text(p.problem): p.answer for p in problems}
    rows = []
    for step in range(args.steps):   # TRL repeats each prompt num_generations times itself
        rows += [{"prompt": chat.prompt_text(p.problem)} for p in problems[step * args.prompts:(step + 1) * args.prompts]]

    def reward(prompts, completions, **kw):
        return [timing_reward(c, gold[p]) for p, c in zip(prompts, completions)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            print(f"  TRL step {len(times)}/{args.steps}: {times[-1]:.2f} s", file=sys.stderr, flush=True)

    out = tempfile.mkdtemp(prefix="trl-", dir=Path(os.environ["RSTAR2_HOME"]).resolve())
    conf = GRPOConfig(output_dir=out, use_cpu=True, num_generations=args.group,
                      per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
                      max_completion_length=args.tokens, max_steps=args.steps, learning_rate=cfg.rl.lr,
                      lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                      loss_type="dapo", temperature=1.0, max_grad_norm=cfg.rl.grad_clip, report_to="none",
                      save_strategy="no", logging_steps=1, seed=0, shuffle_dataset=False, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=conf, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps, P=4")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="checkpoint URL (default: the tiny profile's base model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts = 3, 4
    os.environ.setdefault("RSTAR2_HOME", str(ROOT / ".rstar2"))
    import torch

    torch.set_num_threads(args.threads)
    from rstar2_core.config import load_config
    from rstar2_core.data.synthetic import generate_problems

    cfg = load_config("tiny")
    model, tok, url = get_model(cfg, args.model)
    problems = generate_problems(0, args.steps * args.prompts, "rl")
    t0 = time.time()
    ours = run_ours(cfg, url, tok, problems, args)
    trl_times = run_trl(cfg, copy.deepcopy(model), tok, problems, args)
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs)
    r = {"ours_s_per_step": round(med(ours), 3), "trl_s_per_step": round(med(trl_times), 3),
         "ratio": round(med(ours) / med(trl_times), 3), "target_ratio": 0.7,
         "prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.tokens,
         "steps": args.steps, "threads": args.threads, "model": url,
         "ours_steps_s": [round(x, 3) for x in ours], "trl_steps_s": [round(x, 3) for x in trl_times],
         "wall_s": round(time.time() - t0, 1), "quick": args.quick}
    print(f"ours {r['ours_s_per_step']} s/step | TRL {r['trl_s_per_step']} s/step | ratio {r['ratio']} "
          f"(target <= 0.7); P={args.prompts} G={args.group} max_new_tokens={args.tokens}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
