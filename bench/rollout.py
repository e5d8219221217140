"""Benchmark: synchronous turn-by-turn rollout vs our continuous engine with asynchronous tool dispatch.

Run:  python bench/rollout.py [--quick] [--json] [--tool-latency-s MEAN]

Modes `sync` (verl v0.2 style: each turn waits for the longest, then all tool calls run as one batch),
`async` (`rollout_groups` + `run_trajectory`) and `async_plain` (async without the shared-prefix decode
step). Invariant: every mode uses the same HFEngine, the same real sandbox, prompts and per-trajectory
seeds, so all produce the same turns of the same lengths (checked) and tokens/s differ only by how the
work is scheduled. See docs/benchmarks.md, "bench/rollout.py", and docs/rollout-benchmarks.md, "bench/rollout.py".
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
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from rstar2_core.chat import ChatFormat, parse_tool_calls, render_tool_result
from rstar2_core.chat.prompt import CALL_EXAMPLE, system_prompt, user_message
from rstar2_core.chat.tokens import ANSWER_CLOSE, SPECIAL_TOKENS, TOOL_CALL_CLOSE, TOOL_NAME
from rstar2_core.config import SandboxConfig
from rstar2_core.rollout import HFEngine, RolloutLimits, rollout_groups
from rstar2_core.rollout.agent import turn_seed
from rstar2_core.rollout.scheduler import job_seed
from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.sandbox import ExecutionRequest, LocalSandbox


def tiny_setup(hidden: int = 256, layers: int = 4, vocab: int = 512):
    """(model, tokenizer, chat): a random-init Qwen2 and a byte-level BPE trained on the chat format."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    corpus = [system_prompt(True), CALL_EXAMPLE] + [user_message(f"What is {i} * {i + 7}?") for i in range(200)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=int(hidden * 2.7), max_position_embeddings=4096)
    return Qwen2ForCausalLM(cfg).eval(), tok, ChatFormat(tok)


class ScriptedToolEngine:
    """Wraps an engine: samples a long-tailed number of real tokens per turn, then appends a tool call
    (or, after `tool_turns` turns, an answer) as if the model had written it."""

    def __init__(self, inner: HFEngine, chat: ChatFormat, tool_turns: int, median: float, sigma: float, cap: int):
        self.inner, self.chat, self.tool_turns = inner, chat, tool_turns
        self.median, self.sigma, self.cap = median, sigma, cap
        self.sampled = 0

    def turn_length(self, seed: int) -> int:
        return max(1, min(self.cap, int(random.Random(seed).lognormvariate(math.log(self.median), self.sigma))))

    def suffix(self, seed: int, turn: int) -> tuple[str, str]:
        if turn >= self.tool_turns:
            return "<answer>\\boxed{42}</answer>", ANSWER_CLOSE
        r = random.Random(seed + 1)
        if r.random() < 0.25:
            code = f"import sympy\nprint(sympy.factorint({r.randrange(10**12, 10**13)}))"
        else:
            code = f"print({r.randrange(1000)} * {r.randrange(1000)})"
        return "\n<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}) \
            + "\n</tool_call>", TOOL_CALL_CLOSE

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        turn = (prompt_ids.count(self.chat.im_start_id) - 3) // 2
        n = min(self.turn_length(params.seed), params.max_new_tokens)
        out = await self.inner.generate(prompt_ids, SamplingParams(max_new_tokens=n, temperature=params.temperature,
                                                                   top_p=params.top_p, seed=params.seed))
        self.sampled += len(out.token_ids)
        if n < self.turn_length(params.seed):
            return out                                   # the budget ran out
        text, stop = self.suffix(params.seed, turn)
        ids = self.chat.encode_text(text)
        return GenerationOutput(out.token_ids + tuple(ids), out.logprobs + (0.0,) * len(ids), "stop", stop)

    def kv_capacity_tokens(self) -> int:
        return self.inner.kv_capacity_tokens()

    def kv_tokens_per_sequence(self) -> int:
        return self.inner.kv_tokens_per_sequence()

    def update_weights(self, weights) -> None:
        self.inner.update_weights(weights)

    async def close(self) -> None:
        pass


class RemoteToolLatency:
    """`sandbox` as a remote tool service: a call's answer arrives `latency(req)` after it was sent, or
    when the call has run if that is later (see the module docstring)."""

    def __init__(self, inner, mean_s: float, sigma: float):
        self.inner, self.sigma = inner, sigma
        self.median_s = mean_s / math.exp(sigma * sigma / 2)       # a lognormal's mean is median * e^(s^2/2)

    def latency(self, req: ExecutionRequest) -> float:
        rng = random.Random(zlib.crc32(f"{req.code}\0{req.stdin}".encode()))
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    async def run(self, req: ExecutionRequest):
        t0 = time.perf_counter()
        res = await self.inner.run(req)
        wait = self.latency(req) - (time.perf_counter() - t0)
        if wait > 0:
            await asyncio.sleep(wait)
        return res

    async def run_batch(self, reqs: list[ExecutionRequest]):
        return list(await asyncio.gather(*(self.run(r) for r in reqs)))


async def sync_rollout(engine, sandbox, chat, problems, n, limits, seed) -> list[tuple[int, ...]]:
    """Turn barrier: all trajectories generate, then all their tool calls run as one batch.
    Returns each trajectory's sampled-token count per turn."""
    states = [{"prompt": chat.prompt_ids(p), "ids": [], "seed": job_seed(seed, i, j), "done": False, "turns": []}
              for i, p in enumerate(problems) for j in range(n)]
    for turn in range(limits.max_turns):
        live = [s for s in states if not s["done"]]
        if not live:
            break
        outs = await asyncio.gather(*(engine.generate(s["prompt"] + s["ids"], SamplingParams(
            max_new_tokens=limits.max_response_tokens - len(s["ids"]), temperature=limits.temperature,
            stop_token_ids=chat.eos_token_ids, stop_strings=chat.stop_strings,
            seed=turn_seed(s["seed"], turn))) for s in live))
        calls = []
        for s, out in zip(live, outs):
            s["ids"] += out.token_ids
            s["turns"].append(len(out.token_ids))
            if out.stop_string == TOOL_CALL_CLOSE and turn + 1 < limits.max_turns:
                calls.append((s, parse_tool_calls(chat.tokenizer.decode(list(out.token_ids)))[0]))
            else:
                s["done"] = True
        results = await sandbox.run_batch([ExecutionRequest(code=c.code, stdin=c.stdin) for _, c in calls])
        for (s, _), r in zip(calls, results):
            s["ids"] += chat.tool_response_ids([render_tool_result(r)])
    return [tuple(s["turns"]) for s in states]


def turn_lengths(traj) -> tuple[int, ...]:
    """Generated tokens per turn of a Trajectory (runs of loss_mask == 1)."""
    runs, cur = [], 0
    for m in traj.loss_mask:
        if m:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    return tuple(runs + ([cur] if cur else []))


async def measure(args) -> dict:
    model, tok, chat = tiny_setup()
    problems = [f"What is {i} * {i + 7}?" for i in range(args.problems)]
    limits = RolloutLimits(max_turns=args.tool_turns + 1, max_response_tokens=args.budget)
    prompt_len = max(len(chat.prompt_ids(p)) for p in problems)
    inner = HFEngine(model, tok, max_batch_size=args.problems * args.n, max_seq_len=prompt_len + args.budget + 8)
    plain = HFEngine(model, tok, max_batch_size=args.problems * args.n, max_seq_len=prompt_len + args.budget + 8,
                     shared_prefix=False)
    engines = {m: ScriptedToolEngine(e, chat, args.tool_turns, args.median, args.sigma, args.cap)
               for m, e in (("sync", inner), ("async", inner), ("async_plain", plain))}
    keys = ("decode_steps", "decode_tokens", "decode_s", "prefill_forwards", "prefill_s", "prefill_tokens",
            "prefill_padded_tokens", "reused_tokens", "copied_tokens", "shared_prefix_steps")
    per_mode = {m: dict.fromkeys(keys, 0) for m in engines}
    print(f"[rollout bench] {args.problems * args.n} trajectories x {args.tool_turns} tool turns, turn length "
          f"lognormal(median {args.median}, sigma {args.sigma}, cap {args.cap}), prompt {prompt_len} tokens, "
          f"torch threads {torch.get_num_threads()}, remote tool latency "
          f"{f'mean {args.tool_latency_s} s (sigma {args.tool_latency_sigma})' if args.tool_latency_s > 0 else 'none'}",
          flush=True)
    runs = {m: [] for m in engines}
    async with LocalSandbox(SandboxConfig()) as local:
        sandbox = RemoteToolLatency(local, args.tool_latency_s, args.tool_latency_sigma) \
            if args.tool_latency_s > 0 else local
        for warm in (engines["sync"], engines["async_plain"]):                                  # warm-up
            await sync_rollout(warm, sandbox, chat, problems[:2], 1, limits, seed=999)
        for rep in range(args.repeats):
            for mode, engine in engines.items():
                engine.sampled = 0
                before = dict(engine.inner.stats)
                t0 = time.perf_counter()
                if mode == "sync":
                    seqs = await sync_rollout(engine, sandbox, chat, problems, args.n, limits, seed=rep)
                else:
                    groups = await rollout_groups(engine, sandbox, chat, problems, args.n, limits, seed=rep)
                    seqs = [turn_lengths(t) for g in groups for t in g]
                    finishes = [t.finish for g in groups for t in g]
                    if set(finishes) != {"answer"}:
                        print(f"[rollout bench] async finishes {finishes} "
                              f"{[t.infra_error for g in groups for t in g if t.infra_error]}", flush=True)
                dt = time.perf_counter() - t0
                for k in keys:
                    per_mode[mode][k] += engine.inner.stats[k] - before[k]
                runs[mode].append((engine.sampled / dt, dt, engine.sampled, seqs))
                print(f"[rollout bench] rep {rep + 1}/{args.repeats} {mode:5s}: {engine.sampled} sampled tokens "
                      f"in {dt:.2f} s = {engine.sampled / dt:.0f} tokens/s", flush=True)
            if not runs["sync"][-1][3] == runs["async"][-1][3] == runs["async_plain"][-1][3]:
                raise SystemExit("the runs produced different turn structures: the comparison is invalid")
        await inner.close()
        await plain.close()
    sync_tps = statistics.median(r[0] for r in runs["sync"])
    async_tps = statistics.median(r[0] for r in runs["async"])
    plain_tps = statistics.median(r[0] for r in runs["async_plain"])
    engine_figures = {m: {"decode_steps": f["decode_steps"],
                          "rows_per_step": round(f["decode_tokens"] / max(1, f["decode_steps"]), 2),
                          "decode_ms_per_step": round(1000 * f["decode_s"] / max(1, f["decode_steps"]), 2),
                          "decode_s": round(f["decode_s"], 2), "prefill_forwards": f["prefill_forwards"],
                          "prefill_s": round(f["prefill_s"], 2), "prefill_tokens": f["prefill_tokens"],
                          "prefill_padded_tokens": f["prefill_padded_tokens"], "reused_tokens": f["reused_tokens"],
                          "copied_tokens": f["copied_tokens"], "shared_prefix_steps": f["shared_prefix_steps"]}
                      for m, f in per_mode.items()}
    st = inner.stats
    return {
        "sync_tokens_per_s": round(sync_tps, 1), "async_tokens_per_s": round(async_tps, 1),
        "ratio": round(async_tps / sync_tps, 3), "same_turn_structure": True,
        "async_plain_tokens_per_s": round(plain_tps, 1), "shared_prefix_ratio": round(async_tps / plain_tps, 3),
        "engine": engine_figures, "load_avg": os.getloadavg(),
        "sync_wall_s": [round(r[1], 2) for r in runs["sync"]], "async_wall_s": [round(r[1], 2) for r in runs["async"]],
        "async_plain_wall_s": [round(r[1], 2) for r in runs["async_plain"]],
        "sampled_tokens": runs["sync"][0][2], "trajectories": args.problems * args.n, "tool_turns": args.tool_turns,
        "tool_latency_mean_s": args.tool_latency_s, "tool_latency_sigma": args.tool_latency_sigma,
        "decode_step_ms": round(1000 * st["decode_s"] / max(1, st["decode_steps"]), 3),
        "decode_tokens_per_step": round(st["decode_tokens"] / max(1, st["decode_steps"]), 2),
        "prefill_ms_per_token": round(1000 * st["prefill_s"] / max(1, st["prefill_tokens"]), 4),
        "prefix_reused_tokens": st["reused_tokens"],
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={torch.get_num_threads()}".strip(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 trajectories, one repeat (a few minutes on a busy machine)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--problems", type=int, default=None)
    ap.add_argument("--n", type=int, default=2, help="trajectories per problem")
    ap.add_argument("--tool-turns", type=int, default=3)
    ap.add_argument("--median", type=float, default=24.0, help="median sampled tokens per turn")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the turn length (long tail)")
    ap.add_argument("--cap", type=int, default=192, help="most sampled tokens per turn")
    ap.add_argument("--budget", type=int, default=1536, help="max_response_tokens")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tool-latency-s", type=float, default=0.0,
                    help="mean latency of a remote tool service per call (0: the local calls' own time)")
    ap.add_argument("--tool-latency-sigma", type=float, default=1.0, help="lognormal sigma of that latency")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared, loaded machine 2 OpenMP threads run ~10x slower)")
    args = ap.parse_args()
    if args.tool_latency_s < 0 or args.tool_latency_sigma < 0:
        ap.error("--tool-latency-s and --tool-latency-sigma must be >= 0")
    import torch
    torch.set_num_threads(args.threads)
    args.problems = args.problems or (4 if args.quick else 16)
    args.repeats = args.repeats or (1 if args.quick else 3)
    out = asyncio.run(measure(args))
    print(f"[rollout bench] sync {out['sync_tokens_per_s']} tokens/s, async {out['async_tokens_per_s']} tokens/s, "
          f"ratio {out['ratio']}x (target >= 1.5); async without the shared-prefix step "
          f"{out['async_plain_tokens_per_s']} tokens/s ({out['shared_prefix_ratio']}x)")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
