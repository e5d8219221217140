"""GPU check (issue 9): training and decode throughput of our pieces on one accelerator, ~5 minutes on an H200.

For a tiny and a Qwen2.5-0.5B-shaped random-init Qwen2 model (bf16, sdpa attention) it measures:
- SFT step (`TorchBackend`: fwd + bwd + AdamW, causal-LM loss on B x T tokens): tokens/s and MFU;
- RL step: rollouts from our `HFEngine`, then `rl.trainer.rl_update` (recomputed old log-probs +
  clipped policy loss + one optimizer step): generation tokens/s, update tokens/s and MFU;
- DeepSpeed ZeRO-2 step (`DeepSpeedBackend`, one process) when deepspeed is importable;
- decode tokens/s of `HFEngine` vs `model.generate` at the same batch (256 on GPU), same sampling
  semantics (temperature 1, no top-k/top-p, every sequence runs to max_new_tokens), measured in this run;
  the engine runs eager and, on CUDA, with `static_shapes=True, compile=True`.
MFU = flops / time / peak with flops = 6 x params x tokens for a training step (8 x for the RL update,
which adds the old-log-prob forward); peak = dense bf16 peak of the device from PEAK_TFLOPS (H200: 989),
or, for an unknown device or the CPU, the bf16/fp32 matmul rate measured here (`peak_source` says which).

Needs only torch + transformers (+ deepspeed, optional): it imports only the pieces of rstar2_core that
pull in nothing else (no prefect/ray/mlflow/pydantic), so it runs on a bare GPU box from a checkout.

    python bench/gpu_check.py --json                 # GPU, ~5 min
    python bench/gpu_check.py --cpu --quick --json   # CPU smoke test (tests/unit/infra/test_gpu_check.py)
The last line with --json is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch


def _light_packages() -> None:
    """Register rstar2_core's `models`, `rollout` and `rl` packages without running their __init__
    (which re-export modules that need pydantic/fsspec through the config); only the submodules this
    script imports (backend, deepspeed_backend, hf_engine, trainer and their torch-only imports) run."""
    import importlib
    import types

    importlib.import_module("rstar2_core")
    for name in ("models", "rollout", "rl"):
        full = f"rstar2_core.{name}"
        if full not in sys.modules:
            pkg = types.ModuleType(full)
            pkg.__path__ = [str(ROOT / "rstar2_core" / name)]
            sys.modules[full] = pkg


_light_packages()

PEAK_TFLOPS = {  # dense bf16, per device
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
    "L40S": 362.0, "MI300X": 1307.0, "MI325X": 1307.0, "MI300A": 980.0, "MI250X": 383.0,
}
SHAPES = {
    "tiny": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "vocab_size": 512},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "vocab_size": 151936},
    "cpu-small": {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "vocab_size": 512},
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    reps, t = 0, time.perf_counter()
    while time.perf_counter() - t < 1.0 or reps < 3:
        a @ b
        reps += 1
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def device_peak(device: torch.device, measured: float) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
            if key in name.upper().replace("INSTINCT ", ""):
                return peak, f"table ({key})"
    return measured, "measured matmul"


# --------------------------------------------------------------------------------------------- steps
def _random_batch(vocab: int, b: int, t: int, device: torch.device) -> torch.Tensor:
    return torch.randint(3, vocab, (b, t), device=device)


def sft_step(model, backend, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    vocab = model.config.vocab_size
    model.train()
    times = []
    for i in range(steps + 1):
        ids = _random_batch(vocab, batch, seq, device)
        sync(device)
        t = time.perf_counter()
        with backend.autocast() if hasattr(backend, "autocast") else _null():
            loss = backend.model(input_ids=ids, labels=ids).loss
        backend.backward(loss)
        backend.step()
        sync(device)
        if i:  # the first step warms up kernels and allocator
            times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    return {"step_s": step_s, "tokens_per_s": batch * seq / step_s, "loss": float(loss)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


async def _engine_generate(engine, prompts: list[list[int]], new_tokens: int, seed: int = 0):
    from rstar2_core.rollout.types import SamplingParams

    return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                     seed=seed + i))
                                  for i, p in enumerate(prompts)])


def make_engine(model, batch: int, max_len: int, device: torch.device, fast: bool):
    from rstar2_core.rollout.hf_engine import HFEngine

    return HFEngine(model, None, max_batch_size=batch, device=device, max_seq_len=max_len,
                    static_shapes=fast, compile=fast)


def rl_step(model, backend, batch: int, prompt_len: int, new_tokens: int, device: torch.device) -> dict:
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.rollout.types import Trajectory

    vocab = model.config.vocab_size
    prompts = _random_batch(vocab, batch, prompt_len, device).tolist()
    engine = make_engine(model, batch, prompt_len + new_tokens + 8, device, fast=False)
    try:
        model.eval()
        sync(device)
        t = time.perf_counter()
        outs = asyncio.run(_engine_generate(engine, prompts, new_tokens))
        sync(device)
        gen_s = time.perf_counter() - t
    finally:
        asyncio.run(engine.close())
    trajs = [Trajectory(tuple(p), o.token_ids, (1,) * len(o.token_ids), o.logprobs, "", (), 1, 0, "max_tokens", True)
             for p, o in zip(prompts, outs)]
    adv = [1.0 if i % 2 else -1.0 for i in range(batch)]
    sync(device)
    t = time.perf_counter()
    m = rl_update(backend, trajs, adv, pad_id=0, micro_batch_size=min(batch, 16))
    sync(device)
    upd_s = time.perf_counter() - t
    gen_tokens = sum(len(o.token_ids) for o in outs)
    seq_tokens = sum(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    return {"gen_s": gen_s, "gen_tokens_per_s": gen_tokens / gen_s, "update_s": upd_s,
            "update_tokens_per_s": seq_tokens / upd_s, "update_tokens": seq_tokens,
            "grad_norm": m["actor/grad_norm"], "engine_logprob_gap": m["actor/engine_logprob_gap"]}


def decode_bench(model, batch: int, prompt_len: int, new_tokens: int, device: torch.device) -> dict:
    vocab = model.config.vocab_size
    prompts = _random_batch(vocab, batch, prompt_len, device)
    out: dict = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
    model.eval()
    with torch.no_grad():
        model.generate(prompts[:2, :8], max_new_tokens=2, do_sample=True, pad_token_id=0)  # warm-up
        sync(device)
        t = time.perf_counter()
        gen = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        sync(device)
        s = time.perf_counter() - t
    assert gen.shape == (batch, prompt_len + new_tokens)
    out["generate_tokens_per_s"] = batch * new_tokens / s
    variants = [("engine", False)] + ([("engine_static_compiled", True)] if device.type == "cuda" else [])
    for name, fast in variants:
        engine = make_engine(model, batch, prompt_len + new_tokens + 8, device, fast)
        try:
            # warm-up / compile on other prompts: the same prompts would hit the engine's prefix cache
            warm = _random_batch(vocab, batch, prompt_len, device).tolist()
            asyncio.run(_engine_generate(engine, warm, new_tokens))
            sync(device)
            before = dict(engine.stats)
            t = time.perf_counter()
            res = asyncio.run(_engine_generate(engine, prompts.tolist(), new_tokens, seed=10_000))
            sync(device)
            s = time.perf_counter() - t
        finally:
            asyncio.run(engine.close())
        toks = sum(len(r.token_ids) for r in res)
        assert toks == batch * new_tokens, f"{name} stopped early ({toks} of {batch * new_tokens} tokens)"
        dec_s = engine.stats["decode_s"] - before["decode_s"]
        out[f"{name}_tokens_per_s"] = toks / s
        out[f"{name}_decode_only_tokens_per_s"] = toks / dec_s if dec_s > 0 else None
        out[f"{name}_vs_generate"] = out[f"{name}_tokens_per_s"] / out["generate_tokens_per_s"]
    return out


def deepspeed_step(model, lr: float, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"skipped": "deepspeed not installed"}
    from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = DeepSpeedBackend(model, zero_stage=2, lr=lr, total_steps=100, warmup_steps=0, schedule="constant")
    try:
        return sft_step(model, backend, batch, seq, steps, device)
    finally:
        backend.close()  # the process group stays: DeepSpeed caches it for the next model


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--models", default=None, help=f"comma list of {list(SHAPES)} (default tiny,0.5b; "
                    "--cpu: tiny,cpu-small; --cpu --quick: cpu-small)")
    ap.add_argument("--decode-batch", type=int, default=None, help="decode benchmark batch (GPU default 256)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    a = ap.parse_args(argv)
    from rstar2_core.models.backend import TorchBackend

    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA/ROCm device visible to torch; run with --cpu for the CPU smoke test")
    device = torch.device("cpu" if a.cpu else "cuda")
    dtype = torch.float32 if a.cpu else torch.bfloat16
    quick = a.quick
    default_models = ("cpu-small" if quick else "tiny,cpu-small") if a.cpu else "tiny,0.5b"
    models = (a.models or default_models).split(",")
    sft_b, sft_t, steps = (4, 64, 1 if quick else 2) if a.cpu else ((4, 512, 3) if quick else (8, 2048, 5))
    rl_b, rl_prompt, rl_new = (4, 16, 8) if a.cpu else ((32, 128, 64) if quick else (64, 128, 256))
    dec_b = a.decode_batch or (8 if a.cpu else (64 if quick else 256))
    dec_prompt, dec_new = (8, 16) if a.cpu else (128, 64 if quick else 256)
    name = "cpu" if a.cpu else torch.cuda.get_device_name(device)
    measured = matmul_tflops(device, dtype, 512 if a.cpu else 8192)
    peak, peak_src = device_peak(device, measured)
    log(f"device {name}; matmul {measured:.1f} TFLOP/s ({dtype}); peak {peak:.1f} TFLOP/s ({peak_src})")
    result: dict = {"device": name, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                    "matmul_tflops": measured, "peak_tflops": peak, "peak_source": peak_src, "models": {}}
    for shape in models:
        model = build_model(shape, device, dtype)
        n = n_params(model)
        r: dict = {"params": n}
        log(f"{shape}: {n / 1e6:.1f}M parameters")
        backend = TorchBackend(model, lr=1e-5, total_steps=100, warmup_steps=0, schedule="constant")
        r["sft"] = sft_step(model, backend, sft_b, sft_t, steps, device)
        r["sft"]["mfu"] = 6 * n * r["sft"]["tokens_per_s"] / (peak * 1e12)
        log(f"{shape} SFT step {sft_b}x{sft_t}: {r['sft']['step_s']:.3f} s, {r['sft']['tokens_per_s']:,.0f} tok/s, "
            f"MFU {r['sft']['mfu']:.1%}")
        r["rl"] = rl_step(model, backend, rl_b, rl_prompt, rl_new, device)
        r["rl"]["update_mfu"] = 8 * n * r["rl"]["update_tokens_per_s"] / (peak * 1e12)
        log(f"{shape} RL step {rl_b} rollouts x {rl_new} tokens: generate {r['rl']['gen_s']:.2f} s "
            f"({r['rl']['gen_tokens_per_s']:,.0f} tok/s), update {r['rl']['update_s']:.2f} s "
            f"(MFU {r['rl']['update_mfu']:.1%})")
        del backend
        if not a.no_decode:
            r["decode"] = decode_bench(model, dec_b, dec_prompt, dec_new, device)
            d = r["decode"]
            log(f"{shape} decode batch {dec_b}: generate {d['generate_tokens_per_s']:,.0f} tok/s; engine "
                f"{d['engine_tokens_per_s']:,.0f} tok/s ({d['engine_vs_generate']:.2f}x)"
                + (f"; static+compiled {d['engine_static_compiled_tokens_per_s']:,.0f} tok/s "
                   f"({d['engine_static_compiled_vs_generate']:.2f}x)" if "engine_static_compiled_vs_generate" in d else ""))
        if not a.no_deepspeed:
            r["deepspeed_zero2"] = deepspeed_step(model, 1e-5, sft_b, sft_t, steps, device)
            z = r["deepspeed_zero2"]
            if "tokens_per_s" in z:
                z["mfu"] = 6 * n * z["tokens_per_s"] / (peak * 1e12)
                z["vs_torch"] = z["tokens_per_s"] / r["sft"]["tokens_per_s"]
                log(f"{shape} DeepSpeed ZeRO-2 step: {z['tokens_per_s']:,.0f} tok/s, MFU {z['mfu']:.1%} "
                    f"({z['vs_torch']:.2f}x torch)")
            else:
                log(f"{shape} DeepSpeed: {z['skipped']}")
        result["models"][shape] = r
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    result["wall_s"] = time.perf_counter() - T0
    log(f"done in {result['wall_s']:.0f} s")
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
