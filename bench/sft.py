"""Benchmark: SFT step throughput with segment attention vs the dense block mask, and RL log-probs chunked vs plain.

Run:  python bench/sft.py [--quick] [--json] [--threads N]

Three parts: the SFT step (`sft.step.sft_update`) on the same packed rows three ways (merged prefix,
segment attention, dense mask), in turn step by step; an RL update micro-batch with the system turn once
vs whole; RL log-probs at a long length, packed and chunked vs the plain computation, each in its own
subprocess (peak memory and seconds). See docs/benchmarks-training.md, "bench/sft.py".
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

VOCAB_LP = 32_000


def build_rows(n_sft: int, workdir: Path):
    """(config, model, tokenizer, packed rows) of the tiny profile with `n_sft` tool demonstrations."""
    from rstar2_core.chat import ChatFormat
    from rstar2_core.config import load_config
    from rstar2_core.models import load_model_and_tokenizer, prepare_base_model
    from rstar2_core.sft.data import build_sft_dataset, read_sft_rows
    from rstar2_core.sft.packing import encode_conversations, epoch_rows

    cfg = load_config("tiny", [f"data.synthetic.n_sft={n_sft}"])
    base = prepare_base_model(cfg, (workdir / "base").as_uri())
    ref = build_sft_dataset(cfg, (workdir / "sft.jsonl").as_uri())
    model, tok = load_model_and_tokenizer(base, dtype="float32")
    chat = ChatFormat(tok)
    docs, _ = encode_conversations(read_sft_rows(ref.url), chat, cfg.sft.max_seq_len)
    pad = tok.pad_token_id if tok.pad_token_id is not None else chat.im_end_id
    rows = epoch_rows(docs, 1, cfg.sft.seed, cfg.sft.max_seq_len, pad, cfg.sft.pack)
    return cfg, model, rows, pad


def bench_sft(args) -> dict:
    from rstar2_core.models.backend import make_backend
    from rstar2_core.sft.step import sft_update

    with tempfile.TemporaryDirectory() as tmp:
        print("[sft bench] building the tiny profile's model and SFT rows ...", flush=True)
        cfg, model, rows, pad_id = build_rows(args.n_sft, Path(tmp))
    sc = cfg.sft
    model.train()
    backend = make_backend(model, sc, total_steps=10 ** 6, warmup_steps=0, schedule="constant")
    batches = [rows[i:i + sc.batch_size] for i in range(0, len(rows) - sc.batch_size + 1, sc.batch_size)]
    if not batches:
        raise SystemExit(f"only {len(rows)} rows; raise --n-sft")
    modes = ("merged", "segments", "dense")
    times: dict[str, list[float]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    total = len(modes) * (args.steps + 1)
    for k in range(total):
        mode = modes[k % len(modes)]
        batch = batches[(k // len(modes)) % len(batches)]
        start = time.perf_counter()
        sft_update(backend, batch, micro_batch_size=sc.micro_batch_size, pad_id=pad_id, dense_mask=mode == "dense",
                   merge_prefix=mode == "merged", max_tokens_per_micro_batch=sc.max_tokens_per_micro_batch)
        dt = time.perf_counter() - start
        if k >= len(modes):                          # the first step of each mode is a warm-up
            times[mode].append(dt)
        el = time.perf_counter() - t0
        print(f"[sft bench] step {k + 1}/{total} ({mode}): {dt * 1e3:.0f} ms  "
              f"[{el:.0f} s, ETA {el / (k + 1) * (total - k - 1):.0f} s]", flush=True)
    real = statistics.mean(sum(r.n_real for r in b) for b in batches)
    out = {m: real / statistics.median(times[m]) for m in times}
    return {**{f"{m}_tokens_per_s": round(out[m], 1) for m in modes},
            "ratio": round(out["segments"] / out["dense"], 3), "merge_ratio": round(out["merged"] / out["segments"], 3),
            **{f"{m}_step_ms": round(statistics.median(times[m]) * 1e3, 1) for m in modes},
            "steps_each": args.steps, "rows_per_step": sc.batch_size, "row_tokens": sc.max_seq_len,
            "real_tokens_per_step": round(real), "conversations_per_row": round(
                statistics.mean(r.n_docs for r in rows), 2), "rows": len(rows)}


def _lp_setup(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rstar2_core.rollout.types import Trajectory

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB_LP, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                                         max_position_embeddings=args.lp_tokens + 8, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    per = args.lp_tokens // args.lp_trajectories
    trajs = []
    for b in range(args.lp_trajectories):
        n = per - 64 - 37 * b                      # lengths differ a little, as in a GRPO batch
        ids = torch.randint(1, VOCAB_LP, (64 + n,), generator=g).tolist()
        trajs.append(Trajectory(tuple(ids[:64]), tuple(ids[64:]), (1,) * n, (0.0,) * n, "", (), 1, 0, "eos", False))
    return model, trajs


def _plain_logprobs(model, trajs, temperature: float) -> torch.Tensor:
    """The computation `batch_logprobs` replaced: right-padded batch, full logits, log-softmax, gather."""
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    R = max(len(t.response_ids) for t in trajs)
    ids = torch.zeros((len(trajs), L), dtype=torch.long)
    att = torch.zeros((len(trajs), L), dtype=torch.long)
    pos = torch.zeros((len(trajs), R), dtype=torch.long)
    tgt = torch.zeros((len(trajs), R), dtype=torch.long)
    for b, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.response_ids)
        ids[b, :P + n], att[b, :P + n] = torch.tensor(t.prompt_ids + t.response_ids), 1
        pos[b, :n], tgt[b, :n] = torch.arange(P - 1, P - 1 + n), torch.tensor(t.response_ids)
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    picked = torch.gather(logits, 1, pos[..., None].expand(-1, -1, logits.shape[-1])).float() / temperature
    return torch.gather(torch.log_softmax(picked, -1), 2, tgt[..., None]).squeeze(-1)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def lp_child(args) -> None:
    """One measurement in this fresh process: print {"peak_mb", "s", "checksum"}."""
    from rstar2_core.rl.logprobs import batch_logprobs, collate

    torch.set_num_threads(args.threads)
    model, trajs = _lp_setup(args)
    model.train()
    batch = collate(trajs, 0)
    base = _rss_mb()
    t0 = time.perf_counter()
    if args.child == "chunked":
        lp = batch_logprobs(model, batch, 0.7)
    else:
        lp = _plain_logprobs(model, trajs, 0.7)
    (lp * batch.valid).sum().backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": round(peak - base, 1), "s": round(dt, 3),
                      "values": [round(float(x), 5) for x in lp.detach()[batch.valid][:64]]}))


def bench_logprobs(args) -> dict:
    res = {}
    for mode in ("chunked", "plain"):
        print(f"[sft bench] log-probs, {mode}, {args.lp_tokens} tokens x vocab {VOCAB_LP} (subprocess) ...", flush=True)
        cmd = [sys.executable, __file__, "--child", mode, "--lp-tokens", str(args.lp_tokens),
               "--lp-trajectories", str(args.lp_trajectories), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    diff = max(abs(a - b) for a, b in zip(res["chunked"]["values"], res["plain"]["values"]))
    return {"tokens": args.lp_tokens, "trajectories": args.lp_trajectories, "vocab": VOCAB_LP,
            "chunked_peak_mb": res["chunked"]["peak_mb"], "plain_peak_mb": res["plain"]["peak_mb"],
            "memory_ratio": round(res["plain"]["peak_mb"] / max(res["chunked"]["peak_mb"], 1e-9), 2),
            "chunked_s": res["chunked"]["s"], "plain_s": res["plain"]["s"],
            "time_ratio": round(res["plain"]["s"] / res["chunked"]["s"], 3), "max_abs_diff": diff}


def bench_rl_prefix(args) -> dict:
    """An RL update micro-batch (the profile's 16 trajectories: two GRPO groups of 8 on real tiny-profile
    prompts, seeded response lengths 80-380) through `rl.logprobs.collate` + `batch_logprobs` forward and
    backward, the system turn packed once (`prefix_len = ChatFormat.shared_prompt_len`: what the update
    runs) vs each trajectory whole (`prefix_len = 0`), in turn; medians."""
    from rstar2_core.chat import ChatFormat
    from rstar2_core.config import load_config
    from rstar2_core.data.synthetic import generate_problems
    from rstar2_core.models import load_model_and_tokenizer, prepare_base_model
    from rstar2_core.rl.logprobs import batch_logprobs, collate
    from rstar2_core.rollout.types import Trajectory

    cfg = load_config("tiny", ["rl.micro_batch_size=16"])      # one micro-batch of 16 trajectories, two groups
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_model_and_tokenizer(prepare_base_model(cfg, (Path(tmp) / "base").as_uri()), dtype="float32")
    model.train()
    chat = ChatFormat(tok)
    g = torch.Generator().manual_seed(0)
    per_group = cfg.rl.grpo.group_size
    trajs = []
    for p in generate_problems(0, cfg.rl.micro_batch_size // per_group, "rl"):
        prompt = tuple(chat.prompt_ids(p.problem))
        for _ in range(per_group):
            n = int(torch.randint(80, 381, (1,), generator=g))
            resp = tuple(torch.randint(5, len(tok) - 1, (n,), generator=g).tolist())
            trajs.append(Trajectory(prompt, resp, (1,) * n, (0.0,) * n, "", (), 1, 0, "eos", False))
    modes = {"shared_prefix": chat.shared_prompt_len, "whole": 0}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(2 * (args.steps + 1)):
        mode = list(modes)[k % 2]
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        batch = collate(trajs, 0, prefix_len=modes[mode])
        batch_logprobs(model, batch, cfg.rl.temperature).sum().backward()
        if k >= 2:
            times[mode].append(time.perf_counter() - start)
        rows = batch.input_ids.shape[1]
        print(f"[sft bench] RL micro-batch {k + 1}/{2 * (args.steps + 1)} ({mode}, {rows} tokens): "
              f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"trajectories": len(trajs), "prompt_tokens": len(trajs[0].prompt_ids),
            "response_tokens_mean": round(statistics.mean(len(t.response_ids) for t in trajs), 1),
            **{f"{m}_ms": round(v * 1e3, 1) for m, v in med.items()}, "ratio": round(med["whole"] / med["shared_prefix"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and steps, 4,096 log-prob tokens (two chunks)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=12, help="timed SFT steps per layout")
    ap.add_argument("--n-sft", type=int, default=96, help="tool demonstrations to build rows from")
    ap.add_argument("--lp-tokens", type=int, default=8192)
    ap.add_argument("--lp-trajectories", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared, loaded machine 2 ran up to ~10x slower)")
    ap.add_argument("--child", choices=("chunked", "plain"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        lp_child(args)
        return
    if args.quick:
        args.steps, args.n_sft, args.lp_tokens = min(args.steps, 3), min(args.n_sft, 32), min(args.lp_tokens, 4096)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = {"sft": bench_sft(args), "rl_prefix": bench_rl_prefix(args), "logprobs": bench_logprobs(args),
           "threads": args.threads,
           "torch": torch.__version__, "wall_s": None, "date": time.strftime("%Y-%m-%d", time.gmtime())}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    s, lp = out["sft"], out["logprobs"]
    print(f"[sft bench] SFT step: merged prefix {s['merged_tokens_per_s']} tokens/s, segments "
          f"{s['segments_tokens_per_s']}, dense mask {s['dense_tokens_per_s']}: merged/segments {s['merge_ratio']}x, "
          f"segments/dense {s['ratio']}x; log-probs at {lp['tokens']} tokens: peak "
          f"{lp['chunked_peak_mb']} MB chunked vs {lp['plain_peak_mb']} MB plain ({lp['memory_ratio']}x), "
          f"{lp['chunked_s']} s vs {lp['plain_s']} s; RL micro-batch, shared prefix once vs whole trajectories: "
          f"{out['rl_prefix']['ratio']}x")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
