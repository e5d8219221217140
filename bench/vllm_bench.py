"""Benchmark: the same rollout workload on the HF engine and on vLLM (its CPU build here), in one run, plus
what the RL step needs from vLLM: its log-probs against the trainer's, and a weight sync that lands.

    python bench/vllm.py [--quick] [--json] [--model URL]      (this file: bench/vllm_bench.py)

Both engines are built by `build_engine` from the same checkpoint and run `rollout_groups` (the RL step's
scheduler and agent loop, the real sandbox) on the same problems. No speed target on CPU: vLLM's CPU build
is here to check correctness. See docs/benchmarks.md, "bench/vllm.py and bench/vllm_bench.py".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


async def rollout(engine, sandbox, chat, problems, n, limits, seed):
    from rstar2_core.rollout import rollout_groups

    t = time.perf_counter()
    groups = await rollout_groups([engine], sandbox, chat, problems, n, limits, seed=seed)
    secs = time.perf_counter() - t
    trajs = [x for g in groups for x in g]
    return trajs, secs, sum(sum(x.loss_mask) for x in trajs)


def gaps(model, trajs, pad_id):
    """(mean, max) |engine - trainer| log-prob over sampled tokens."""
    import torch

    from rstar2_core.rl.logprobs import sequence_logprobs

    mine = sequence_logprobs(model, trajs, pad_id, 1.0)
    diffs = [(torch.tensor(t.logprobs) - m).abs()[torch.tensor(t.loss_mask, dtype=torch.bool)]
             for t, m in zip(trajs, mine)]
    d = torch.cat([x for x in diffs if x.numel()])
    return float(d.mean()), float(d.max())


async def main_async(args, url: str) -> dict:
    import copy

    from rstar2_core.chat import ChatFormat
    from rstar2_core.config import load_config
    from rstar2_core.data.synthetic import generate_problems
    from rstar2_core.faults import stale_weights
    from rstar2_core.models.io import load_model_and_tokenizer
    from rstar2_core.rollout.types import RolloutLimits
    from rstar2_core.runtime.engine_builder import EngineSpec, build_engine
    from rstar2_core.sandbox import LocalSandbox

    cfg = load_config("tiny")
    model, tok = load_model_and_tokenizer(url)
    chat = ChatFormat(tok)
    probs = [p.problem for p in generate_problems(7, args.problems + 2, "eval")]
    warm, timed = probs[:2], probs[2:]
    limits = RolloutLimits(max_turns=3, max_response_tokens=args.max_tokens, temperature=1.0)
    max_len = len(chat.prompt_ids(timed[0])) + args.max_tokens + 64
    res: dict = {"workload": {"problems": len(timed), "n": args.n, "max_tokens": args.max_tokens,
                              "max_batch_size": args.batch, "model": url}}
    async with LocalSandbox(cfg.sandbox) as sandbox:
        for kind in ("hf", "vllm"):
            t = time.perf_counter()
            engine = build_engine(EngineSpec(kind, url, max_len, max_batch_size=args.batch, dtype="float32"))
            start = time.perf_counter() - t
            log(f"{kind}: engine built in {start:.1f} s")
            try:
                await rollout(engine, sandbox, chat, warm, 2, limits, seed=99)
                trajs, secs, tokens = await rollout(engine, sandbox, chat, timed, args.n, limits, seed=1)
                res[kind] = {"tokens_per_s": tokens / secs, "tokens": tokens, "seconds": secs}
                log(f"{kind}: {tokens} sampled tokens in {secs:.1f} s = {tokens / secs:.0f} tokens/s")
                if kind == "vllm":
                    res["engine_start_s"] = start
                    res["logprob_gap_mean"], res["logprob_gap_max"] = gaps(model, trajs, tok.pad_token_id)
                    new_sd = stale_weights(model.state_dict(), noise=0.3, seed=5)
                    t = time.perf_counter()
                    engine.update_weights(new_sd)
                    res["sync_s"] = time.perf_counter() - t
                    new = copy.deepcopy(model)
                    new.load_state_dict(new_sd)
                    after, _, _ = await rollout(engine, sandbox, chat, timed[:2], 2, limits, seed=3)
                    res["post_sync_gap_mean"], res["post_sync_gap_max"] = gaps(new.eval(), after, tok.pad_token_id)
                    # against the old weights the same tokens are far off: the sync really changed them
                    res["post_sync_gap_vs_old_max"] = gaps(model, after, tok.pad_token_id)[1]
                    log(f"vllm: gap mean {res['logprob_gap_mean']:.2e} max {res['logprob_gap_max']:.2e}; sync "
                        f"{res['sync_s']:.2f} s, after it max {res['post_sync_gap_max']:.2e} (vs old weights "
                        f"{res['post_sync_gap_vs_old_max']:.2f})")
            finally:
                await engine.close()
    res["ratio"] = res["vllm"]["tokens_per_s"] / res["hf"]["tokens_per_s"]
    res["load_1min_end"] = os.getloadavg()[0]
    res["cpus"] = os.cpu_count()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 problems x 8 samples of up to 256 tokens (~1 minute)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--model", default=None, help="checkpoint URL (default: the tiny profile's base model)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("RSTAR2_HOME", ".rstar2"), "bench", "vllm"))
    ap.add_argument("--problems", type=int, default=None)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    args.problems = args.problems or (4 if args.quick else 8)
    args.n = args.n or (8 if args.quick else 16)
    args.max_tokens = args.max_tokens or (256 if args.quick else 512)
    from rstar2_core.config import load_config
    from rstar2_core.models.prepare import prepare_base_model

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    url = args.model or prepare_base_model(load_config("tiny"), (out / "base").as_uri())
    res = asyncio.run(main_async(args, url))
    if args.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
