"""Benchmark: the GPU memory plan's trainer part against a real ZeRO-3 rank's peak, on this CPU machine.

    .venv/bin/python bench/memory_plan.py [--models smollm2-135m,0.5b] [--ranks 2] [--tokens 2048] [--json]

Per model shape, `--ranks` gloo processes each build a `TrainerShardActor` (the Ray runtime's rank, called in
process: ZeRO-3 under `zero.Init`, gradient checkpointing) and run two `rl_update`s over micro-batches of
`--tokens` tokens. Measured: each rank's anonymous RSS at its highest above its level before the model was built
(glibc's mmap threshold fixed, so that freed tensors leave RSS).
Predicted: `runtime/gpu_memory.trainer_update` in float32 without the GPU-only parts. JSON (last line): per
model `measured_gb`, `predicted_gb`, `ratio`; target |ratio - 1| <= 0.25. See docs/production.md, "Memory per GPU".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

GIB = float(1 << 30)


def rss() -> int:
    """This process's anonymous resident memory (RssAnon: heap and anonymous maps, where tensors live; not the
    libraries' code pages nor the shared-memory buffers of DeepSpeed's CPU collectives)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


class PeakSampler(threading.Thread):
    """The process's highest RSS seen while it runs (sampled every `period_s`)."""

    def __init__(self, period_s: float = 0.002):
        super().__init__(daemon=True)
        self.period_s, self.peak, self.stop = period_s, rss(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.period_s)


def hf_config(name: str) -> dict:
    from gpu_probes import SHAPES

    return {"model_type": "qwen2", "tie_word_embeddings": True, "max_position_embeddings": 32768, **SHAPES[name]}


def trajectories(n_tokens: int, per: int, vocab: int, seed: int) -> list:
    """Trajectories of `per` tokens (a 32-token prompt, the rest sampled) filling `n_tokens`."""
    import random

    from rstar2_core.rollout.types import Trajectory

    rng = random.Random(seed)
    out = []
    for _ in range(max(1, n_tokens // per)):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(32))
        resp = tuple(rng.randrange(1, vocab) for _ in range(per - 32))
        out.append(Trajectory(prompt, resp, (1,) * len(resp), tuple(-1.0 for _ in resp), "", (), 1, 1, "eos", False))
    return out


def rank_main(rank: int, world: int, port: int, name: str, tokens: int, micro: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    import deepspeed  # noqa: F401 - imported before the baseline: the libraries are not the trainer's memory
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rstar2_core.rl.trainer import RL_STEP, rl_update
    from rstar2_core.runtime.ray.trainer_shards import TrainerShardActor

    cfg = hf_config(name)

    def factory():
        return AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=torch.float32)

    opts = {"lr": 1e-6, "total_steps": 10, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0,
            "gradient_checkpointing": True, "zero_stage": 3, "head_kernel": "torch"}
    base = rss()
    sampler = PeakSampler()
    sampler.start()
    shard = TrainerShardActor(rank, world, factory, opts, RL_STEP, threads=1)
    shard.init("127.0.0.1", port)
    after_init = rss()
    trajs = trajectories(tokens * micro, tokens // 4, cfg["vocab_size"], seed=rank)
    total = float(sum(sum(t.loss_mask) for t in trajs)) * world
    t0 = time.perf_counter()
    for _ in range(2):
        m = rl_update(shard.backend, trajs, [1.0 if i % 2 else -1.0 for i in range(len(trajs))], pad_id=0,
                      micro_batch_size=None, max_tokens_per_micro_batch=tokens, total_tokens=total,
                      num_micro_batches=micro, loss_scale=float(world))
    sampler.stop.set()
    sampler.join()
    out.put({"rank": rank, "baseline_gb": base / GIB, "init_gb": (after_init - base) / GIB,
             "peak_gb": (sampler.peak - base) / GIB, "update_s": (time.perf_counter() - t0) / 2,
             "micro_batches": m["actor/micro_batches"]})


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc otherwise raises its mmap threshold as large blocks are freed and keeps later ones in the heap, where
freed tensors stay resident: RSS would then measure CPU malloc's fragmentation (2-3x the live tensors of a
checkpointed model here), not what a GPU's allocator holds. A fixed threshold maps every block >= 128 KiB on
its own and returns it when freed. Set before the ranks start (glibc reads it at start-up)."""


def measure(name: str, ranks: int, tokens: int, micro: int) -> list[dict]:
    import torch

    os.environ.update(MALLOC_ENV)

    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, ranks, port, name, tokens, micro, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=1800) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(timeout=120)
    return got


def predict(name: str, ranks: int, tokens: int) -> dict:
    from rstar2_core.models.param_count import model_shape
    from rstar2_core.runtime.gpu_memory import trainer_update

    shape = model_shape(hf_config(name))
    parts = trainer_update(shape, tokens=tokens, zero_stage=3, world=ranks, bf16=False, hpz=1, checkpointing=True,
                           contexts=False)
    return {"params": shape.params, "predicted_gb": sum(parts.values()) / GIB,
            "parts_gb": {k: round(v / GIB, 4) for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,0.5b")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (the token budget)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per update")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    results = {}
    for name in a.models.split(","):
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {a.ranks} ZeRO-3 ranks, 2 updates of {a.micro_batches} x "
              f"{a.tokens} tokens ...", flush=True)
        ranks = measure(name, a.ranks, a.tokens, a.micro_batches)
        pred = predict(name, a.ranks, a.tokens)
        measured = max(r["peak_gb"] for r in ranks)
        results[name] = {**pred, "measured_gb": measured, "ratio": pred["predicted_gb"] / measured,
                         "within_25pct": abs(pred["predicted_gb"] / measured - 1) <= 0.25, "ranks": ranks}
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: predicted {pred['predicted_gb']:.2f} GB, measured "
              f"{measured:.2f} GB per rank (ratio {results[name]['ratio']:.2f})", flush=True)
    load = os.getloadavg()[0]
    summary = {"bench": "memory_plan", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "machine": f"{os.cpu_count()} CPU cores", "load_1min_at_end": load, "ranks": a.ranks,
               "tokens_per_micro_batch": a.tokens, "micro_batches": a.micro_batches, "dtype": "float32",
               "models": results, "wall_s": time.perf_counter() - t0}
    print(json.dumps(summary) if a.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
