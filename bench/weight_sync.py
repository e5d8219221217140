"""Benchmark: the trainer -> engine weight push, per transport that runs on CPU, into real engines.

    .venv/bin/python bench/weight_sync.py [--quick] [--json] [--shapes tiny,smollm2-135m,1b] [--object-store-probe 4.5]

Each arm opens the runtime of its transport (`state_dict`, `checkpoint`: local; `object_store`: Ray, one
ZeRO-2 rank) on checkpoint B and times `sync_weights` after putting the engine back on A (B = A + noise).
Exact: the engine's log-probs against B's, `post_sync_gap_max` <= 1e-4; `push_mem_peak_gb`: the machine's
used memory at its highest during a push, above its level before (`--chunk-mib`: vLLM's message size).
JSON: `transports` (the largest vLLM shape), `arms` with `vs_state_dict`. `--quick`: tiny only (~3 min).
See docs/benchmarks-training.md, "bench/weight_sync.py"; nccl/ipc need GPUs (bench/ipc_probe.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

ARMS = (("local", "state_dict"), ("local", "checkpoint"), ("ray", "object_store"))
SHAPES = ("tiny", "smollm2-135m", "1b")
ONE_B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
         "num_key_value_heads": 4}
"""TinyLlama-1.1B's layers (head_dim 64) over the tiny tokenizer's vocabulary: ~0.97B parameters."""
RAY = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"',
       "rl.zero_stage=2", "cluster.trainer_ranks=1"]
EXACT = 1e-4
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def checkpoints(shape: str, out: Path) -> tuple[str, str]:
    """(A, B) checkpoint URLs of `shape`, B = A's weights moved by `stale_weights` (built once, then reused)."""
    import torch

    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.faults import stale_weights
    from rstar2_core.models import prepare_base_model
    from rstar2_core.models.io import load_model_and_tokenizer, save_checkpoint

    a, b = (out / shape / "a").resolve().as_uri(), (out / shape / "b").resolve().as_uri()
    if storage.is_complete(a) and storage.is_complete(b):
        return a, b
    tiny = prepare_base_model(load_config("tiny"), (out / "tiny" / "a").resolve().as_uri())
    if shape == "smollm2-135m":
        from rstar2_core.models.smollm2 import convert_smollm2

        a = convert_smollm2().as_uri()
    elif shape == "1b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        _, tok = load_model_and_tokenizer(tiny)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**ONE_B, vocab_size=len(tok), max_position_embeddings=2048,
                                             tie_word_embeddings=False, torch_dtype="float32"))
        save_checkpoint(model, tok, a, meta={"kind": "bench-1b"})
        del model
    model, tok = load_model_and_tokenizer(a, dtype="float32")
    model.load_state_dict(stale_weights(model.state_dict(), noise=0.3, seed=5))
    save_checkpoint(model, tok, b, meta={"kind": f"bench-{shape}-b"})
    return a, b


def arm_config(runtime: str, transport: str, engine: str):
    from rstar2_core.config import load_config

    over = [f'rollout.engine="{engine}"', "rollout.num_engines=1", "rollout.max_batch_size=2",
            f'rollout.weight_sync="{transport}"', 'model.dtype="float32"']
    if runtime == "ray":
        over += RAY + [f"cluster.cpus_per_node={max(2, os.cpu_count() or 2)}"]
    return load_config("tiny", over)


async def served_gap(engine, prompt: list[int], ref, pad_id: int) -> float:
    """Largest |engine - ref| log-prob over the engine's 16 greedy-ish (seeded) tokens after `prompt`."""
    import torch

    from rstar2_core.rl.logprobs import sequence_logprobs
    from rstar2_core.rollout.types import SamplingParams, Trajectory

    out = await engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=7))
    n = len(out.token_ids)
    t = Trajectory(tuple(prompt), tuple(out.token_ids), (1,) * n, tuple(out.logprobs), "", (), 1, 0, "length", False)
    mine = sequence_logprobs(ref, [t], pad_id, 1.0)[0]
    return float((torch.tensor(out.logprobs) - mine).abs().max())


async def run_arm(runtime: str, transport: str, engine_kind: str, a: str, b: str, ref, prompt, pad_id,
                  repeats: int) -> dict:
    from rstar2_core.rl.trainer import RL_STEP
    from rstar2_core.runtime import TrainerSpec, open_runtime

    cfg = arm_config(runtime, transport, engine_kind)
    trainer = None if transport == "checkpoint" else TrainerSpec("rl", 1, 0, "constant", RL_STEP)
    t0 = time.perf_counter()
    async with open_runtime(cfg, policy_url=b, max_model_len=len(prompt) + 64, trainer=trainer, sandbox=False,
                            grader=False) as rt:
        start_s = time.perf_counter() - t0
        eng = rt.engines[0]
        level = await served_gap(eng, prompt, ref, pad_id)
        secs, peaks, stale, report_bytes = [], [], None, 0
        for _ in range(repeats):
            eng.update_weights(a)                               # back on A: the push must change every weight
            if stale is None:
                stale = await served_gap(eng, prompt, ref, pad_id)
            with MemoryPeak() as mem:
                rep = rt.sync_weights(b)
            secs.append(rep.seconds)
            peaks.append(mem.peak_gb)
            report_bytes = rep.bytes
        post = await served_gap(eng, prompt, ref, pad_id)
    return {"runtime": runtime, "start_s": round(start_s, 1), "seconds": statistics.median(secs),
            "seconds_all": [round(s, 4) for s in secs], "report_bytes": report_bytes, "gap_level": level,
            "stale_gap": stale, "post_sync_gap_max": post, "exact": post <= EXACT,
            "push_mem_peak_gb": round(max(peaks), 3)}


class MemoryPeak:
    """The machine's used memory (psutil: page cache excluded, as Ray's memory monitor counts it) sampled
    every 10 ms while the block runs: `peak_gb` = its highest point above the level at entry. `read` swaps
    the figure sampled (bytes; the tests read this process's RSS, which other processes cannot move)."""

    def __init__(self, read=None):
        import psutil

        self._read = read or (lambda: psutil.virtual_memory().used)

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self.base = self.top = self._read()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.top = max(self.top, self._read())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak_gb = (max(self.top, self._read()) - self.base) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny shape only (~3 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--engines", default="vllm,hf")
    ap.add_argument("--transports", default=",".join(t for _, t in ARMS))
    ap.add_argument("--repeats", type=int, default=3, help="pushes per arm (the median is reported)")
    ap.add_argument("--no-ray-above", type=float, default=0.5,
                    help="skip the Ray arm for shapes above this many billion parameters (a second host copy of "
                         "the weights in the object store, and a DeepSpeed rank: more memory than 24 GiB hold at 1B)")
    ap.add_argument("--object-store-probe", type=float, default=0.0, metavar="GIB",
                    help="also push one GIB-GiB state dict through Ray's object store actor to actor (4.5: past 4 GiB)")
    ap.add_argument("--chunk-mib", type=int, default=0,
                    help="vLLM state_dict messages of this size (in-process engines: the local arms); 0: the default")
    ap.add_argument("--out", default=os.path.join(os.environ.get("RSTAR2_HOME", ".rstar2"), "bench", "weight_sync"))
    args = ap.parse_args(argv)
    shapes = (args.shapes or ("tiny" if args.quick else ",".join(SHAPES))).split(",")
    if bad := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {bad}; valid: {list(SHAPES)}")
    engines, transports = args.engines.split(","), args.transports.split(",")
    if args.chunk_mib:
        from rstar2_core.rollout import vllm_engine

        vllm_engine.WEIGHT_CHUNK_BYTES = args.chunk_mib << 20
    from rstar2_core.chat import ChatFormat
    from rstar2_core.models.io import load_model_and_tokenizer

    out = Path(args.out)
    arms: dict[str, dict] = {}
    plan = [(s, e, rtm, t) for s in shapes for e in engines for rtm, t in ARMS if t in transports]
    done_s, n_done = 0.0, 0
    shape_info: dict[str, dict] = {}
    for shape in shapes:
        a, b = checkpoints(shape, out)
        ref, tok = load_model_and_tokenizer(b, dtype="float32")
        n = sum(p.numel() for p in ref.parameters())
        nbytes = sum(v.numel() * v.element_size() for v in ref.state_dict().values())
        shape_info[shape] = {"params": n, "bytes": nbytes}
        prompt = ChatFormat(tok).prompt_ids("Toy problem 8: what does the program print?")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for engine in engines:
            for runtime, transport in ARMS:
                if transport not in transports:
                    continue
                key = f"{shape}/{engine}/{transport}"
                if runtime == "ray" and n > args.no_ray_above * 1e9:
                    log(f"{key}: skipped (--no-ray-above {args.no_ray_above}B)")
                    plan.remove((shape, engine, runtime, transport))
                    continue
                t = time.perf_counter()
                r = asyncio.run(run_arm(runtime, transport, engine, a, b, ref, prompt, pad, args.repeats))
                r["bytes"], r["gb_per_s"] = nbytes, nbytes / r["seconds"] / 1e9
                arms[key] = r
                (out / "arms.partial.json").write_text(json.dumps(arms, indent=1))   # survives a later failure
                done_s, n_done = done_s + time.perf_counter() - t, n_done + 1
                eta = done_s / n_done * (len(plan) - n_done)
                log(f"{key}: {r['seconds']:.3f} s per push = {r['gb_per_s']:.2f} GB/s ({nbytes / 1e6:.0f} MB); gap "
                    f"level {r['gap_level']:.1e}, stale {r['stale_gap']:.2f}, after {r['post_sync_gap_max']:.1e}; "
                    f"peak +{r['push_mem_peak_gb']:.2f} GB; {n_done}/{len(plan)} arms, ETA {eta:.0f} s")
        del ref
    probe = None
    if args.object_store_probe:          # its own process: the Ray arms left this one connected to Ray
        import subprocess

        ran = subprocess.run([sys.executable, "-m", "rstar2_core.runtime.ray.probes", str(args.object_store_probe)],
                             cwd=ROOT, capture_output=True, text=True, check=False)
        lines = ran.stdout.strip().splitlines()
        probe = json.loads(lines[-1]) if ran.returncode == 0 and lines else {
            "gib": args.object_store_probe, "ok": False, "error": f"exit {ran.returncode}: {ran.stderr[-300:]}"}
        log(f"object-store probe: {probe}")
    for key, r in arms.items():
        base = arms.get(key.rsplit("/", 1)[0] + "/state_dict")
        if base:
            r["vs_state_dict"] = r["gb_per_s"] / base["gb_per_s"]
    summary: dict[str, dict] = {}
    for transport in transports:
        mine = [(k, r) for k, r in arms.items() if k.endswith("/" + transport)]
        if not mine:
            continue
        vllm = [(k, r) for k, r in mine if "/vllm/" in k] or mine
        k, r = max(vllm, key=lambda kr: kr[1]["bytes"])
        summary[transport] = {"arm": k, "seconds": r["seconds"], "gb_per_s": r["gb_per_s"],
                              "post_sync_gap_max": max(x["post_sync_gap_max"] for _, x in mine)}
    res = {"transports": summary, "arms": arms, "shapes": shape_info, "exact": all(r["exact"] for r in arms.values()),
           "object_store_probe": probe,
           "repeats": args.repeats, "chunk_mib": args.chunk_mib or None, "cpus": os.cpu_count(), "load_1min_end": os.getloadavg()[0],
           # the kernel's high-water RSS: it counts the mmapped checkpoint files the arms read (page cache, not
           # memory the push needs); each arm's push_mem_peak_gb is the figure to size a node by
           "max_rss_gb_incl_mapped_files": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
           "seconds": time.perf_counter() - T0}
    print(json.dumps(res) if args.json else json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
