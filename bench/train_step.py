"""Benchmark: the SFT step and the RL update with micro-batches by count (the old cut) and by token budget
(the new default), on a long-tailed response-length mix, at the tiny and the SmolLM2-135M shape (random
init, float32, CPU).

Run:  python bench/train_step.py [--quick] [--json] [--shapes tiny,smollm2-135m]

Both arms run the stages' code (`rl_update`, `sft_update`) in turn on the same long-tailed mix (70% short,
20% medium, 10% at the cap). Attention calls and pad tokens are counted; rank balance is max/min computed
tokens over `--ranks` ranks as the Ray trainer splits them. JSON last: `sft_ratio`, `rl_ratio` (new/old
tokens/s, last shape), `attn_calls_old/new` (a step), `attn_calls_forward_segments/flex` (one forward of
the new cut per kernel), `pad_share_old/new`, `rank_balance` (+ `_old`), per shape under `shapes`. See docs/benchmarks-training.md, "bench/train_step.py".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bench.gpu_probes import build_model

PAD = 1                      # a token no sampled sequence holds: counting it counts padding


class AttentionCalls(TorchFunctionMode):
    """Counts the attention kernel calls made inside: SDPA and FlexAttention (forwards; their backwards are
    no separate calls)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention or getattr(func, "__name__", "") == "flex_attention":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def forward_calls(model, trajs, cut, system: int, kernel: str) -> int:
    """Attention calls of one no-grad log-prob forward over the micro-batches `cut` with `kernel` (the
    flex kernel runs forwards on CPU; its backward needs CUDA)."""
    import warnings

    from rstar2_core.rl.logprobs import batch_logprobs, collate

    with torch.no_grad(), warnings.catch_warnings(), AttentionCalls() as calls:
        warnings.simplefilter("ignore")                     # eager FlexAttention's "use torch.compile"
        for mb in cut:
            batch_logprobs(model, collate([trajs[i] for i in mb], PAD, "cpu", system), kernel=kernel)
    return calls.calls


class PadCount:
    """Forward pre-hook on the decoder: positions run and pad positions among them."""

    def __init__(self, model):
        self.run = self.pad = 0
        self.handle = model.get_decoder().register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.run += ids.numel()
            self.pad += int((ids == PAD).sum())


def response_lengths(n: int, cap: int, rng: random.Random) -> list[int]:
    """Long-tailed: 70% short, 20% medium, 10% at the cap (the truncated tail of an RL stage)."""
    out = []
    for _ in range(n):
        u = rng.random()
        out.append(cap if u < 0.1 else rng.randint(int(0.25 * cap), int(0.6 * cap)) if u < 0.3
                   else rng.randint(max(1, int(0.05 * cap)), int(0.25 * cap)))
    return out


def trajectories(n: int, cap: int, system: int, vocab: int, seed: int):
    from rstar2_core.rollout.types import Trajectory

    rng = random.Random(seed)
    sys_turn = [rng.randrange(2, vocab) for _ in range(system)]
    out = []
    for r in response_lengths(n, cap, rng):
        prompt = sys_turn + [rng.randrange(2, vocab) for _ in range(rng.randint(20, 60))]
        mask = [1 if rng.random() > 0.15 else 0 for _ in range(r)]     # ~15% tool-output tokens
        mask[0] = 1
        out.append(Trajectory(tuple(prompt), tuple(rng.randrange(2, vocab) for _ in range(r)), tuple(mask),
                              tuple(-1.0 for _ in range(r)), "", (), 1, 1, "answer", False))
    return out


def sft_rows(n_docs: int, cap: int, system: int, seq: int, vocab: int, seed: int):
    from rstar2_core.sft.packing import pack

    rng = random.Random(seed)
    sys_turn = [rng.randrange(2, vocab) for _ in range(system)]
    docs = []
    for r in response_lengths(n_docs, min(cap, seq - system - 60), rng):
        user = rng.randint(20, 60)
        docs.append((sys_turn + [rng.randrange(2, vocab) for _ in range(user + r)], [0] * (system + user) + [1] * r))
    return pack(docs, seq, pad_id=PAD, prefix=sys_turn)


def run_arm(model, fn) -> dict:
    pads = PadCount(model)
    with AttentionCalls() as calls:
        t = time.perf_counter()
        m = fn()
        dt = time.perf_counter() - t
    pads.handle.remove()
    return {"s": dt, "attn_calls": calls.calls, "pad_share": pads.pad / max(1, pads.run), "metrics": m}


MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def profile_shares(fn) -> dict:
    """Shares of one run of `fn`'s self CPU time (torch.profiler) spent in attention kernels, in matmuls,
    and elsewhere (elementwise, copies, Python-side dispatch): where the time of a step goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    total = attention = matmul = 0.0
    for e in prof.key_averages():
        t = float(e.self_cpu_time_total)
        total += t
        if "attention" in e.key:
            attention += t
        elif e.key in MATMULS:
            matmul += t
    return {"attention": attention / total, "matmul": matmul / total, "other": 1 - (attention + matmul) / total}


def balance(items, step, ranks: int) -> tuple[float, float]:
    """(old, new) max/min computed tokens over ranks, split as the Ray trainer splits a step of the stage's
    `TrainerStep`: by the tokens trained on (old) and by the tokens computed (new)."""
    from rstar2_core.runtime.ray.sharding import rank_balance, split_by_weight

    size = [step.length(x) for x in items]
    return (rank_balance(split_by_weight(items, ranks, step.weight), size),
            rank_balance(split_by_weight(items, ranks, step.weight, step.length), size))


def alternate(model, label: str, arms: dict, steps: int, data, run, tokens) -> dict:
    """Each arm's step on the same data (`data(step)`), arms in turn and their order flipped every step, the
    first step a warm-up; per arm tokens/s over the timed steps and the last step's counts."""
    res: dict = {k: [] for k in arms}
    for step in range(steps + 1):
        d = data(step)
        for arm, kw in (arms.items() if step % 2 == 0 else reversed(arms.items())):
            r = run_arm(model, lambda kw=kw, d=d: run(d, kw))
            print(f"[train_step] {label} {arm} step {step}: {r['s']:.2f} s, {r['attn_calls']} attention calls", flush=True)
            if step:
                res[arm].append(r | {"tokens": tokens(d)})
    return {arm: {"tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs),
                  "attn_calls": rs[-1]["attn_calls"], "pad_share": rs[-1]["pad_share"], "metrics": rs[-1]["metrics"]}
            for arm, rs in res.items()}


def bench_shape(shape: str, a) -> dict:
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.trainer import RL_STEP, cut_trajectories, rl_update
    from rstar2_core.sft.step import SFT_STEP, sft_update

    model = build_model(shape, torch.device("cpu"), torch.float32)
    vocab = model.config.vocab_size
    backend = TorchBackend(model, lr=1e-7, total_steps=10 ** 6, warmup_steps=0, schedule="constant")
    out: dict = {"shape": shape}

    def rl_data(step):
        trajs = trajectories(a.trajectories, a.cap, a.system, vocab, seed=step)
        return trajs, [1.0 if i % 2 else -1.0 for i in range(len(trajs))]

    def rl_run(d, kw):
        return rl_update(backend, d[0], d[1], pad_id=PAD, prefix_len=a.system, **kw)

    # old = micro_batch_size trajectories (rows) a pass, new = the token budget
    rl_arms = {"old": {"micro_batch_size": a.rl_micro_batch},
               "new": {"micro_batch_size": None, "max_tokens_per_micro_batch": a.rl_budget}}
    rl = alternate(model, f"{shape} rl", rl_arms, a.steps, rl_data, rl_run,
                   lambda d: sum(len(t.prompt_ids) + len(t.response_ids) for t in d[0]))
    last = rl_data(a.steps)
    for arm, r in rl.items():
        out[f"rl_{arm}"] = {k: r[k] for k in ("tokens_per_s", "attn_calls", "pad_share")}
        out[f"rl_{arm}"]["micro_batches"] = r["metrics"]["actor/micro_batches"]
        if a.profile:                                   # an extra, untimed step under the profiler
            out[f"rl_{arm}"]["profile"] = profile_shares(lambda kw=rl_arms[arm]: rl_run(last, kw))
    cut = cut_trajectories(last[0], micro_batch_size=None, max_tokens_per_micro_batch=a.rl_budget, prefix_len=a.system)
    out["rl_forward_calls"] = {k: forward_calls(model, last[0], cut, a.system, k) for k in ("segments", "flex")}
    items = [(t, 1.0) for t in trajectories(a.trajectories * 4, a.cap, a.system, vocab, seed=99)]
    out["rl_rank_balance_old"], out["rl_rank_balance_new"] = balance(items, RL_STEP, a.ranks)

    sft_arms = {"old": {"micro_batch_size": a.sft_micro_batch},
                "new": {"micro_batch_size": None, "max_tokens_per_micro_batch": a.sft_budget}}
    sft = alternate(model, f"{shape} sft", sft_arms, a.steps,
                    lambda step: sft_rows(a.trajectories, a.cap, a.system, a.seq, vocab, seed=100 + step),
                    lambda rows, kw: sft_update(backend, rows, pad_id=PAD, **kw),
                    lambda rows: sum(row.n_real for row in rows))
    for arm, r in sft.items():
        out[f"sft_{arm}"] = {k: r[k] for k in ("tokens_per_s", "attn_calls", "pad_share")}
    rows = sft_rows(a.trajectories * 4, a.cap, a.system, a.seq, vocab, seed=199)
    out["sft_rank_balance_old"], out["sft_rank_balance_new"] = balance(rows, SFT_STEP, a.ranks)
    out["rl_ratio"] = out["rl_new"]["tokens_per_s"] / out["rl_old"]["tokens_per_s"]
    out["sft_ratio"] = out["sft_new"]["tokens_per_s"] / out["sft_old"]["tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape only, 8 trajectories, a 128-token cap, 1 step")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--shapes", default="tiny,smollm2-135m")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per arm (after one warm-up)")
    ap.add_argument("--trajectories", type=int, default=32, help="trajectories (and SFT conversations) a step")
    ap.add_argument("--cap", type=int, default=512, help="response cap of the mix")
    ap.add_argument("--system", type=int, default=96, help="shared system-turn tokens")
    ap.add_argument("--seq", type=int, default=1024, help="SFT row length")
    ap.add_argument("--rl-micro-batch", type=int, default=8, help="old cut: trajectories a pass")
    ap.add_argument("--rl-budget", type=int, default=2048, help="new cut: tokens a pass")
    ap.add_argument("--sft-micro-batch", type=int, default=4, help="old cut: rows a pass")
    ap.add_argument("--sft-budget", type=int, default=4096, help="new cut: tokens a pass")
    ap.add_argument("--ranks", type=int, default=4, help="simulated trainer ranks of the balance figure")
    ap.add_argument("--profile", action="store_true", help="also profile one RL step per arm: time shares of "
                    "attention, matmuls and the rest")
    a = ap.parse_args(argv)
    if a.quick:
        a.shapes, a.trajectories, a.cap, a.steps, a.system, a.seq = "tiny", 8, 128, 1, 32, 512
        a.rl_budget, a.sft_budget = 640, 1024
    torch.manual_seed(0)
    per = {s: bench_shape(s, a) for s in a.shapes.split(",")}
    last = per[a.shapes.split(",")[-1]]
    result = {"bench": "train_step", "device": "cpu", "threads": torch.get_num_threads(),
              "mix": {"trajectories": a.trajectories, "cap": a.cap, "system": a.system, "seq": a.seq,
                      "short_medium_cap": [0.7, 0.2, 0.1]},
              "cuts": {"rl_micro_batch": a.rl_micro_batch, "rl_budget": a.rl_budget,
                       "sft_micro_batch": a.sft_micro_batch, "sft_budget": a.sft_budget},
              "sft_ratio": last["sft_ratio"], "rl_ratio": last["rl_ratio"],
              "attn_calls_old": last["rl_old"]["attn_calls"], "attn_calls_new": last["rl_new"]["attn_calls"],
              "pad_share_old": last["rl_old"]["pad_share"], "pad_share_new": last["rl_new"]["pad_share"],
              "attn_calls_forward_segments": last["rl_forward_calls"]["segments"],
              "attn_calls_forward_flex": last["rl_forward_calls"]["flex"],
              "rank_balance": last["rl_rank_balance_new"], "rank_balance_old": last["rl_rank_balance_old"],
              "shapes": per}
    if a.profile:
        result["rl_profile"] = {arm: last[f"rl_{arm}"]["profile"] for arm in ("old", "new")}
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
