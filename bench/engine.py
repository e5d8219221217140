"""Benchmark: HFEngine (continuous batching) vs HF `model.generate` on the same requests, on CPU.

    python bench/engine.py [--quick] [--json] [--models tiny,smollm2] [--threads 1]

Two models (a tiny random Qwen2, SmolLM2-135M-Instruct) and two workloads on the same prompts: `spread`
(lognormal response lengths, the shape of RL rollouts) and `equal` (same length: the engine must not be
slower). Each workload runs generate/engine pairs back to back; the figure is the median pair ratio, and
`cpu_ratio` the same per process CPU second. See docs/benchmarks.md, "bench/engine.py", and
docs/rollout-benchmarks.md, "bench/engine.py".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def smollm2_model():
    from transformers import AutoModelForCausalLM

    from rstar2_core.models.smollm2 import convert_smollm2

    path = convert_smollm2()      # ~19 s the first time, then a cached bf16 checkpoint
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


# per model: builder, requests, engine slots (= generate batch), prompt length range, spread median and
# cap, equal length
SETUPS = {
    "tiny": {"build": tiny_model, "requests": 96, "slots": 16, "prompt": (8, 48), "median": 48, "cap": 256,
             "equal": 64},
    "smollm2": {"build": smollm2_model, "requests": 32, "slots": 8, "prompt": (8, 40), "median": 24, "cap": 128,
                "equal": 32},
}
QUICK = {"tiny": {"requests": 48, "median": 32, "cap": 160, "equal": 48},
         "smollm2": {"requests": 24, "median": 16, "cap": 64, "equal": 16}}


def workload(vocab: int, n: int, prompt: tuple[int, int], median: int, cap: int, seed: int
             ) -> tuple[list[list[int]], list[int]]:
    """(prompts, spread lengths): lognormal lengths (sigma 0.9) clipped to [1, cap]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    lengths = [max(1, min(cap, round(median * math.exp(rng.gauss(0.0, 0.9))))) for _ in range(n)]
    return prompts, lengths


def run_engine(model, prompts: list[list[int]], lengths: list[int], slots: int, seed: int
               ) -> tuple[float, float, dict]:
    from rstar2_core.rollout.hf_engine import HFEngine
    from rstar2_core.rollout.types import SamplingParams

    max_len = max(len(p) for p in prompts) + max(lengths) + 2
    engine = HFEngine(model, None, max_batch_size=slots, max_seq_len=max_len)

    async def go(ps, ls, base):
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                         seed=base + i))
                                      for i, (p, n) in enumerate(zip(ps, ls))])

    async def main():
        try:
            # warm-up on prompts whose first token differs (the measured ones must not hit the prefix cache)
            await go([[2] + p[1:] for p in prompts[:slots]],
                     [4] * min(slots, len(prompts)), seed + 10**6)
            before = dict(engine.stats)
            t, c = time.perf_counter(), time.process_time()
            outs = await go(prompts, lengths, seed)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            return wall, cpu, outs, {k: v - before[k] for k, v in engine.stats.items() if k in before}
        finally:
            await engine.close()

    wall, cpu, outs, stats = asyncio.run(main())
    got = [len(o.token_ids) for o in outs]
    if got != lengths:
        raise RuntimeError(f"engine stopped at the wrong lengths: {got[:8]} vs {lengths[:8]}")
    return wall, cpu, stats


def run_generate(model, prompts: list[list[int]], lengths: list[int], batch: int) -> tuple[float, float, int]:
    """(wall s, process CPU s, decode steps) of batched `generate` with per-row lengths."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowLengths(StoppingCriteria):
        """Row i is done once it has generated lengths[i] tokens (a per-row bool, as EOS would give)."""

        def __init__(self, start: int, want: list[int]):
            self.start, self.want = start, torch.tensor(want)

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.start) >= self.want

    def one_batch(ps, ls):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max(ls), pad_token_id=0, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([RowLengths(width, ls)]))
        if out.shape[1] - width != max(ls):
            raise RuntimeError(f"generate ran {out.shape[1] - width} steps, expected {max(ls)}")
        return max(ls)

    with torch.no_grad():
        one_batch(prompts[:2], [2, 3])                    # warm-up
        t, c = time.perf_counter(), time.process_time()
        steps = sum(one_batch(prompts[i:i + batch], lengths[i:i + batch]) for i in range(0, len(prompts), batch))
        return time.perf_counter() - t, time.process_time() - c, steps


def bench_model(name: str, quick: bool, seed: int, repeats: int, slots: int | None = None,
                requests: int | None = None) -> dict:
    s = dict(SETUPS[name], **(QUICK[name] if quick else {}))
    s.update({k: v for k, v in (("slots", slots), ("requests", requests)) if v})
    t = time.perf_counter()
    model = s["build"]()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {n_params / 1e6:.1f}M parameters, loaded in {time.perf_counter() - t:.1f} s; "
        f"{s['requests']} requests, {s['slots']} slots")
    prompts, spread = workload(model.config.vocab_size, s["requests"], s["prompt"], s["median"], s["cap"], seed)
    out: dict = {"params": n_params, "requests": s["requests"], "slots": s["slots"],
                 "prompt_tokens": sum(len(p) for p in prompts)}
    for wl, lengths in (("spread", spread), ("equal", [s["equal"]] * s["requests"])):
        r: dict = {"tokens": sum(lengths), "max_len": max(lengths), "mean_len": sum(lengths) / len(lengths)}
        gen, eng, gen_cpu, eng_cpu = [], [], [], []
        for rep in range(repeats):      # alternate the two sides so that load drift hits both alike
            g_s, g_cpu, g_steps = run_generate(model, prompts, lengths, s["slots"])
            e_s, e_cpu, stats = run_engine(model, prompts, lengths, s["slots"], seed)
            gen.append(r["tokens"] / g_s)
            eng.append(r["tokens"] / e_s)
            gen_cpu.append(r["tokens"] / g_cpu)
            eng_cpu.append(r["tokens"] / e_cpu)
            log(f"{name} {wl} [{rep + 1}/{repeats}]: generate {gen[-1]:,.0f} tok/s ({g_s:.1f} s), engine "
                f"{eng[-1]:,.0f} tok/s ({e_s:.1f} s): {eng[-1] / gen[-1]:.2f}x (per CPU second "
                f"{eng_cpu[-1] / gen_cpu[-1]:.2f}x); load {os.getloadavg()[0]:.1f}")
        r["generate_tokens_per_s"] = statistics.median(gen)
        r["engine_tokens_per_s"] = statistics.median(eng)
        r["ratio"] = statistics.median(e / g for e, g in zip(eng, gen))
        r["ratios"] = [e / g for e, g in zip(eng, gen)]
        r["cpu_ratio"] = statistics.median(e / g for e, g in zip(eng_cpu, gen_cpu))
        r["generate_decode_steps"] = g_steps
        r["engine"] = {"decode_steps": stats["decode_steps"],
                       "rows_per_step": stats["decode_tokens"] / max(1, stats["decode_steps"]),
                       "prefill_forwards": stats.get("prefill_forwards"),    # absent before batched prefill
                       "prefill_share": stats["prefill_s"] / max(1e-9, stats["prefill_s"] + stats["decode_s"]),
                       "decode_ms_per_step": 1000 * stats["decode_s"] / max(1, stats["decode_steps"])}
        out[wl] = r
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and shorter responses")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--models", default="tiny,smollm2", help=f"comma list of {list(SETUPS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="generate/engine pairs per workload (3; --quick 1)")
    ap.add_argument("--slots", type=int, default=None, help="engine slots = generate batch (default per model)")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (default per model)")
    a = ap.parse_args(argv)
    unknown = [m for m in a.models.split(",") if m not in SETUPS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; valid: {list(SETUPS)}")
    torch.set_num_threads(a.threads)
    import transformers

    res: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "machine": platform.machine(), "threads": a.threads, "quick": a.quick,
                 "load_avg_start": os.getloadavg()[0], "models": {}}
    for name in a.models.split(","):
        res["models"][name] = bench_model(name, a.quick, a.seed, a.repeats or (1 if a.quick else 3), a.slots,
                                          a.requests)
    res["ratio"] = min(m["spread"]["ratio"] for m in res["models"].values())
    res["equal_ratio"] = min(m["equal"]["ratio"] for m in res["models"].values())
    res["load_avg_end"] = os.getloadavg()[0]
    res["wall_s"] = time.perf_counter() - T0
    log(f"spread ratio {res['ratio']:.2f}x (min over models), equal {res['equal_ratio']:.2f}x; "
        f"{res['wall_s']:.0f} s")
    if a.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
