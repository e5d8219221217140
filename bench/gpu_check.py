"""GPU check (issues 9, 17): correctness gates and throughput of our pieces on one accelerator, <= 6 minutes on an H200.

Sections, each timed and each under a hard time budget (SIGALRM; a section over budget is stopped
and reported, the next one runs; the whole check also stops at `--budget` seconds, 360 by default):
- versions: torch, transformers, CUDA/HIP, device name, capability and memory, printed first;
- gates (bench/gpu_gates.py, fp32 with TF32 off): HFEngine greedy == `model.generate` greedy on fixed
  prompts (eager, and on CUDA with `cuda_graphs=True`; on CPU with `static_shapes=True`), and on prompts
  sharing a 96-token prefix (the shared-prefix decode step, which must have run); engine
  logprobs == a teacher-forced forward within `LOGPROB_TOL`; the counter-based sampler's uniforms on
  the device == the pure-Python reference;
- per model (tiny and a Qwen2.5-0.5B-shaped random-init Qwen2, bf16, sdpa attention):
  SFT step (`TorchBackend`: the stage's `sft.step.sft_update` on B packed rows of T tokens that share a
  system-turn prefix, one micro-batch, + AdamW): tokens/s and MFU;
  RL step: rollouts from `HFEngine`, then `rl.trainer.rl_update` (recomputed old log-probs + clipped
  policy loss + one optimizer step): generation tokens/s, update tokens/s and MFU;
  decode tokens/s of `HFEngine` vs `model.generate` at the same batch (256 on GPU), same sampling
  semantics (temperature 1, no top-k/top-p, every sequence runs to max_new_tokens), this run; the
  engine eager and, on CUDA, with CUDA graphs;
  DeepSpeed ZeRO-2 step (`DeepSpeedBackend`, one process) when deepspeed is importable;
- head kernel, where Liger is usable (CUDA + liger-kernel): `token_logprobs` through Liger's fused linear
  cross-entropy vs the chunked torch path on the 0.5B shape's LM head (vocab 151,936): the fp32 gate
  (gpu_gates.head_kernel_gate), then bf16 forward + backward time and peak memory of both on one
  micro-batch of tokens; the SFT step is then also timed with `head_kernel = "torch"` (the default
  `auto` takes Liger where usable). Skipped, with the reasons, elsewhere.
MFU = flops / time / peak with flops = 6 x params x tokens for a training step (SFT: `sft_flops`, the
LM head counted at label positions only, where the step runs it; 8 x params for the RL update, which adds
the old-log-prob forward); peak = dense bf16 peak of the device from PEAK_TFLOPS (H200: 989),
or, for an unknown device or the CPU, the bf16/fp32 matmul rate measured here (`peak_source` says which).

Needs only torch + transformers (+ deepspeed, optional): the rstar2_core modules it imports load
without prefect/ray/mlflow/pydantic/fsspec (tests/unit/infra/test_gpu_check.py runs it with those
hidden). Exit status 1 when a gate fails or a section errors or runs out of time.

    python bench/gpu_check.py --json                 # GPU, ~2-4 min
    python bench/gpu_check.py --cpu --quick --json   # CPU smoke test (the test above; ~1 min)
The last line with --json is one JSON object with every figure (`ok`, `versions`, `sections`, `gates`,
`head_kernel`, `models`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))      # gpu_gates

import torch

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
# engine logprobs vs a teacher-forced forward, fp32: CUDA kernels differ between a batched decode step
# (masked, memory-efficient) and a full forward (causal), so the GPU gets more room than the CPU
LOGPROB_TOL = {"cpu": 1e-4, "cuda": 2e-3}
# Liger's fused head vs the torch path, fp32 (TF32 off): log-prob max |diff| and the gradients' relative error.
# Both compute the same fp32 logits in a different order (chunking, a fused kernel); a wrong reduction or
# upstream-gradient handling is off by O(1)
HEAD_TOL = 1e-3
# hard time budget per section, seconds. GPU: what keeps the whole check under 6 minutes on an H200
# (expected ~2-4). CPU (the smoke test): a fresh clone JIT-builds DeepSpeed's CPU communication op
# (~3.5 minutes on the 2-core development machine) the first time.
BUDGETS = {
    "cuda": {"total": 360, "versions": 30, "matmul": 30, "gates": 90, "head_kernel": 60, "build": 60, "sft": 60,
             "rl": 90, "decode": 120, "deepspeed_zero2": 150},
    "cpu": {"total": 900, "versions": 60, "matmul": 60, "gates": 240, "head_kernel": 30, "build": 60, "sft": 120,
            "rl": 120, "decode": 120, "deepspeed_zero2": 480},
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, the device synchronised before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def gpu_probe(doc: str, run, add_args=None) -> dict:
    """`main` of a GPU-only probe (bench/sdpa_shapes.py, bench/head_kernel_calls.py): `--json` (+ what
    `add_args(parser)` adds), refused without CUDA, then `run(args, device) -> dict`, its JSON printed last."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    if add_args:
        add_args(ap)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (what it measures, cuDNN plans and Triton kernels, exists only there)")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           **run(a, device)}
    res["wall_s"] = time.perf_counter() - t0
    if a.json:
        print(json.dumps(res))
    return res


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


def sft_flops(model, computed_tokens: float, label_tokens: float) -> float:
    """Training flops of one SFT step: 6 x (parameters outside the embeddings and the LM head) per computed
    token, plus 6 x the LM head's parameters per label token (the step runs the head only there); the
    embedding lookup is no matmul. Attention's quadratic term is left out, as in the usual 6N count."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = n_params(model) - emb.numel() - (0 if head is emb else head.numel())
    return 6 * body * computed_tokens + 6 * head.numel() * label_tokens


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


def sft_rows(vocab: int, batch: int, seq: int, seed: int = 0) -> list:
    """`batch` packed rows of `seq` tokens shaped like the SFT data (`sft.packing.pack`): conversations that
    share a system-turn prefix (seq / 4 tokens, at most 600, no labels), each a user part without labels and
    an assistant part with them, random token ids."""
    import random

    from rstar2_core.sft.packing import pack

    rnd = random.Random(seed)
    prefix = [rnd.randrange(3, vocab) for _ in range(min(600, seq // 4))]
    docs, rows = [], []
    while len(rows) <= batch:            # one row more than needed: the last row may be part-filled
        body = rnd.randrange(max(4, seq // 8), max(5, seq // 3))
        user = body // 4
        ids = prefix + [rnd.randrange(3, vocab) for _ in range(body)]
        docs.append((ids, [0] * (len(prefix) + user) + [1] * (body - user)))
        rows = pack(docs, seq, pad_id=0, prefix=prefix)
    return rows[:batch]


def sft_step(model, backend, batch: int, seq: int, steps: int, device: torch.device, seed0: int = 0) -> dict:
    """The SFT step the stage runs (`sft.step.sft_update`: the rows' shared prefix once per micro-batch,
    segment attention per conversation, the LM head only at label positions) on `batch` rows of `seq`
    tokens in one micro-batch. `tokens_per_s` counts the rows' real tokens (prefix once per row, as the data
    holds them); `computed_tokens_per_s` the tokens the forward ran (prefix once per micro-batch), which
    is what the MFU counts. Rows are new every step (seeds seed0, seed0 + 1, ...), as in training: a second
    call compared with the first takes another seed0, or it would reuse what the first one paid for."""
    from rstar2_core.sft.step import sft_update

    vocab = model.config.vocab_size
    times, m = [], {}
    for i in range(steps + 1):
        rows = sft_rows(vocab, batch, seq, seed=seed0 + i)
        sync(device)
        t = time.perf_counter()
        m = sft_update(backend, rows, micro_batch_size=batch, pad_id=0)
        sync(device)
        if i:  # the first step warms up kernels and allocator
            times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    computed = m["sft/computed_tokens"]
    return {"step_s": step_s, "tokens_per_s": m["sft/real_tokens"] / step_s, "computed_tokens_per_s": computed / step_s,
            "label_tokens": m["sft/label_tokens"], "loss": m["sft/loss_sum"] / max(1.0, m["sft/label_tokens"]),
            "grad_norm": m["sft/grad_norm"],
            "tflops_per_s": sft_flops(model, computed, m["sft/label_tokens"]) / step_s / 1e12}


async def _engine_generate(engine, prompts: list[list[int]], new_tokens: int, seed: int = 0):
    from rstar2_core.rollout.types import SamplingParams

    return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                     seed=seed + i))
                                  for i, p in enumerate(prompts)])


def make_engine(model, batch: int, max_len: int, **kw):
    from rstar2_core.rollout.hf_engine import HFEngine

    return HFEngine(model, None, max_batch_size=batch, device=model.device, max_seq_len=max_len, **kw)


def engine_variants(device: torch.device) -> dict[str, dict]:
    """eager (the default) and the fixed-shape variant: CUDA graphs on CUDA, static shapes on CPU."""
    if device.type == "cuda":
        return {"engine": {}, "engine_graphs": {"cuda_graphs": True}}
    return {"engine": {}, "engine_static": {"static_shapes": True}}


def rl_step(model, backend, batch: int, prompt_len: int, new_tokens: int, device: torch.device) -> dict:
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.rollout.types import Trajectory

    vocab = model.config.vocab_size
    prompts = _random_batch(vocab, batch, prompt_len, device).tolist()
    engine = make_engine(model, batch, prompt_len + new_tokens + 8)
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
    variants = engine_variants(device) if device.type == "cuda" else {"engine": {}}
    for name, kw in variants.items():
        engine = make_engine(model, batch, prompt_len + new_tokens + 8, **kw)
        try:
            # warm-up (and graph capture) on other prompts: the same prompts would hit the prefix cache
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
        steps = engine.stats["decode_steps"] - before["decode_steps"]
        dec_s = engine.stats["decode_s"] - before["decode_s"]
        out[f"{name}_tokens_per_s"] = toks / s
        out[f"{name}_decode_ms_per_step"] = 1000 * dec_s / steps if steps else None
        out[f"{name}_vs_generate"] = out[f"{name}_tokens_per_s"] / out["generate_tokens_per_s"]
        if kw.get("cuda_graphs"):
            out[f"{name}_graphs_captured"] = engine.stats["cuda_graphs"]
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
        return sft_step(model, backend, batch, seq, steps, device, seed0=2000)   # rows no other arm ran
    finally:
        backend.close()  # the process group stays: DeepSpeed caches it for the next model


# -------------------------------------------------------------------------------- sections, main
class SectionTimeout(Exception):
    """A section ran past its time budget."""


class Sections:
    """Runs named sections under a hard time budget each (and a global deadline); records time and status."""

    def __init__(self, total_budget_s: float):
        self.deadline = time.perf_counter() + total_budget_s
        self.record: dict[str, dict] = {}

    def run(self, name: str, budget_s: float, fn, *args, **kwargs):
        limit = min(budget_s, self.deadline - time.perf_counter())
        if limit < 1:
            self.record[name] = {"status": "skipped: the check's total budget is spent", "s": 0.0}
            log(f"{name}: skipped (total budget spent)")
            return None

        def on_alarm(signum, frame):
            raise SectionTimeout(f"{name} ran past its {limit:.0f} s budget")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        t, value, status = time.perf_counter(), None, "ok"
        try:
            value = fn(*args, **kwargs)
        except SectionTimeout as e:
            status = f"timeout: {e}"
        except Exception as e:  # noqa: BLE001 - the check reports every section, then fails at the end
            status = f"error: {type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        self.record[name] = {"status": status, "s": round(time.perf_counter() - t, 2), "budget_s": round(limit, 1)}
        log(f"{name}: {status} in {self.record[name]['s']:.1f} s (budget {limit:.0f} s)")
        return value


def versions(device: torch.device) -> dict:
    import platform

    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
         "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "device": "cpu"}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        v.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                 device_count=torch.cuda.device_count())
    try:                                  # the version without importing it (that takes ~15 s)
        v["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        v["deepspeed"] = None
    return v


def gates(device: torch.device, quick: bool) -> dict:
    """fp32 (TF32 off) greedy and logprob gates on the 0.5B shape (GPU) / cpu-small (CPU), and the RNG gate."""
    import gpu_gates

    shape = "cpu-small" if device.type == "cpu" else ("tiny" if quick else "0.5b")
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = build_model(shape, device, torch.float32).eval()
        new = 16 if device.type == "cpu" else 32
        out = {"model": shape, "dtype": "float32", "rng": gpu_gates.rng_gate(device),
               "greedy": gpu_gates.greedy_gate(model, make_engine, engine_variants(device), new),
               "greedy_shared_prefix": gpu_gates.greedy_gate(model, make_engine, {"engine": {}}, new,
                                                             prompts=gpu_gates.shared_prompts(model.config.vocab_size)),
               "logprobs": gpu_gates.logprob_gate(model, make_engine, new, LOGPROB_TOL[device.type])}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
    shared = out["greedy_shared_prefix"]
    shared["ok"] = shared["ok"] and shared["variants"]["engine"]["shared_prefix_steps"] > 0
    out["ok"] = all(out[k]["ok"] for k in ("rng", "greedy", "greedy_shared_prefix", "logprobs"))
    g = dict(out["greedy"]["variants"], engine_shared_prefix=shared["variants"]["engine"])
    log(f"gates ({shape}, fp32): rng {out['rng']['ok']}; greedy == generate "
        + ", ".join(f"{k} {v['exact']} exact + {v['near_ties']} near ties, {len(v['wrong'])} wrong" for k, v in g.items())
        + f"; logprobs max |diff| {out['logprobs']['max_abs_diff']:.2e} (tol {LOGPROB_TOL[device.type]:.0e})")
    return out


def liger_obstacles_on(device: torch.device) -> list[str]:
    """Why Liger's fused head cannot run on `device` ([] when it can), as the backends decide it."""
    from rstar2_core.models.token_logprobs import liger_obstacles

    return liger_obstacles(torch.nn.Linear(8, 8, bias=False), on_cuda=device.type == "cuda", partitioned=False)


def head_kernel(device: torch.device, quick: bool) -> dict:
    """Liger vs torch `token_logprobs` on the 0.5B shape's head (tiny with --quick): the fp32 gate, then bf16
    forward + backward of one micro-batch of tokens (median of 3 after a warm-up that compiles Liger's
    Triton kernels): ms and peak memory above what was allocated before, per kernel."""
    import gpu_gates

    obstacles = liger_obstacles_on(device)
    if obstacles:
        return {"skipped": "; ".join(obstacles)}
    shape = SHAPES["tiny" if quick else "0.5b"]
    hid, vocab = shape["hidden_size"], shape["vocab_size"]
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out: dict = {"gate": gpu_gates.head_kernel_gate(device, hid, vocab, 2048, HEAD_TOL)}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
    tokens = 4096 if quick else 16384
    head = gpu_gates.LMHead(hid, vocab, device, torch.bfloat16)
    hidden, targets, upstream = gpu_gates.head_inputs(head, tokens)
    bf16: dict = {"tokens": tokens, "hidden_size": hid, "vocab": vocab}
    for mode in ("torch", "liger"):
        def step(m=mode):
            gpu_gates.head_forward_backward(head, m, hidden, targets, upstream)

        step()                                  # warm-up (Liger: Triton compiles here)
        sync(device)
        head.lm_head.weight.grad = None
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        times = [timed(step, device) for _ in range(3)]
        bf16[mode] = {"fwd_bwd_ms": 1000 * sorted(times)[1],
                      "peak_extra_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20}
    ref = gpu_gates.head_pass(head, "torch", hidden, targets, upstream, 1.0)
    got = gpu_gates.head_pass(head, "liger", hidden, targets, upstream, 1.0)
    bf16.update(liger_speedup=bf16["torch"]["fwd_bwd_ms"] / bf16["liger"]["fwd_bwd_ms"],
                logprob_max_abs_diff=float((got[0] - ref[0]).abs().max()),
                logprob_mean_abs_diff=float((got[0] - ref[0]).abs().mean()),
                grad_hidden_rel_err=gpu_gates.rel_err(got[1], ref[1]),
                grad_weight_rel_err=gpu_gates.rel_err(got[2], ref[2]))
    out.update(bf16=bf16, ok=out["gate"]["ok"])
    g = out["gate"]
    log(f"head kernel (fp32 gate, {hid}x{vocab}): log-prob max |diff| {g['logprob_max_abs_diff']:.1e}, grad rel err "
        f"{g['grad_hidden_rel_err']:.1e} / {g['grad_weight_rel_err']:.1e} (tol {HEAD_TOL:.0e}): {g['ok']}; bf16 "
        f"{tokens} tokens: torch {bf16['torch']['fwd_bwd_ms']:.1f} ms / {bf16['torch']['peak_extra_mib']:.0f} MiB, "
        f"liger {bf16['liger']['fwd_bwd_ms']:.1f} ms / {bf16['liger']['peak_extra_mib']:.0f} MiB")
    return out


def model_sections(sec: Sections, shape: str, a, device, dtype, peak: float) -> dict:
    budget = BUDGETS[device.type]
    from rstar2_core.models.backend import TorchBackend

    quick, cpu = a.quick, a.cpu
    sft_b, sft_t, steps = (4, 64, 1 if quick else 2) if cpu else ((4, 512, 3) if quick else (8, 2048, 5))
    rl_b, rl_prompt, rl_new = (4, 16, 8) if cpu else ((32, 128, 64) if quick else (64, 128, 256))
    dec_b = a.decode_batch or (8 if cpu else (64 if quick else 256))
    dec_prompt, dec_new = (8, 16) if cpu else (128, 64 if quick else 256)
    model = sec.run(f"{shape}/build", budget["build"], build_model, shape, device, dtype)
    if model is None:
        return {}
    n = n_params(model)
    r: dict = {"params": n}
    log(f"{shape}: {n / 1e6:.1f}M parameters")
    backend = TorchBackend(model, lr=1e-5, total_steps=100, warmup_steps=0, schedule="constant")
    sft = sec.run(f"{shape}/sft", budget["sft"], sft_step, model, backend, sft_b, sft_t, steps, device)
    r["head_kernel"] = "torch" if liger_obstacles_on(device) else "liger"    # what `auto` takes in these steps
    if sft:
        r["sft"] = dict(sft, mfu=sft["tflops_per_s"] / peak)
        log(f"{shape} SFT step {sft_b}x{sft_t} ({r['head_kernel']} head): {sft['step_s']:.3f} s, "
            f"{sft['tokens_per_s']:,.0f} tok/s, MFU {r['sft']['mfu']:.1%}")
    if sft and r["head_kernel"] == "liger":    # the same step with the chunked torch head, for the comparison
        from rstar2_core.models.token_logprobs import head_kernel_of, set_head_kernel

        before = head_kernel_of(model)
        set_head_kernel(model, "torch")
        try:
            alt = sec.run(f"{shape}/sft_torch_head", budget["sft"], sft_step, model, backend, sft_b, sft_t, steps,
                          device, seed0=1000)
        finally:
            set_head_kernel(model, before)
        if alt:
            r["sft_torch_head"] = dict(alt, mfu=alt["tflops_per_s"] / peak)
            log(f"{shape} SFT step, torch head: {alt['tokens_per_s']:,.0f} tok/s, MFU {r['sft_torch_head']['mfu']:.1%}")
    rl = sec.run(f"{shape}/rl", budget["rl"], rl_step, model, backend, rl_b, rl_prompt, rl_new, device)
    if rl:
        r["rl"] = dict(rl, update_mfu=8 * n * rl["update_tokens_per_s"] / (peak * 1e12))
        log(f"{shape} RL step {rl_b} rollouts x {rl_new} tokens: generate {rl['gen_s']:.2f} s "
            f"({rl['gen_tokens_per_s']:,.0f} tok/s), update {rl['update_s']:.2f} s (MFU {r['rl']['update_mfu']:.1%})")
    del backend
    if not a.no_decode:
        d = sec.run(f"{shape}/decode", budget["decode"], decode_bench, model, dec_b, dec_prompt, dec_new,
                    device)
        if d:
            r["decode"] = d
            log(f"{shape} decode batch {dec_b}: generate {d['generate_tokens_per_s']:,.0f} tok/s; "
                + "; ".join(f"{k.removesuffix('_tokens_per_s')} {v:,.0f} tok/s ({d[k.replace('tokens_per_s', 'vs_generate')]:.2f}x)"
                            for k, v in d.items() if k.startswith("engine") and k.endswith("_tokens_per_s")))
    if not a.no_deepspeed:
        z = sec.run(f"{shape}/deepspeed_zero2", budget["deepspeed_zero2"], deepspeed_step, model, 1e-5, sft_b, sft_t,
                    steps, device)
        if z is not None:
            r["deepspeed_zero2"] = z
            if "tokens_per_s" in z and "sft" in r:
                z["mfu"] = z["tflops_per_s"] / peak
                z["vs_torch"] = z["tokens_per_s"] / r["sft"]["tokens_per_s"]
                log(f"{shape} DeepSpeed ZeRO-2 step: {z['tokens_per_s']:,.0f} tok/s, MFU {z['mfu']:.1%} "
                    f"({z['vs_torch']:.2f}x torch)")
            elif "skipped" in z:
                log(f"{shape} DeepSpeed: {z['skipped']}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--models", default=None, help=f"comma list of {list(SHAPES)} (default tiny,0.5b; "
                    "--cpu: tiny,cpu-small; --cpu --quick: cpu-small)")
    ap.add_argument("--decode-batch", type=int, default=None, help="decode benchmark batch (GPU default 256)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole check (hard; GPU 360, "
                    "CPU 900)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    a = ap.parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA/ROCm device visible to torch; run with --cpu for the CPU smoke test")
    device = torch.device("cpu" if a.cpu else "cuda")
    dtype = torch.float32 if a.cpu else torch.bfloat16
    default_models = ("cpu-small" if a.quick else "tiny,cpu-small") if a.cpu else "tiny,0.5b"
    models = (a.models or default_models).split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        ap.error(f"unknown model shape(s) {unknown}; valid: {list(SHAPES)}")
    budget = BUDGETS[device.type]
    sec = Sections(a.budget or budget["total"])
    result: dict = {"versions": sec.run("versions", budget["versions"], versions, device) or {"device": str(device)}}
    log("versions: " + json.dumps(result["versions"]))
    measured = sec.run("matmul", budget["matmul"], matmul_tflops, device, dtype, 512 if a.cpu else 8192) or 0.0
    peak, peak_src = device_peak(device, measured)
    log(f"device {result['versions']['device']}; matmul {measured:.1f} TFLOP/s ({dtype}); "
        f"peak {peak:.1f} TFLOP/s ({peak_src})")
    result.update(device=result["versions"]["device"], dtype=str(dtype).removeprefix("torch."),
                  torch=torch.__version__, matmul_tflops=measured, peak_tflops=peak, peak_source=peak_src)
    result["gates"] = sec.run("gates", budget["gates"], gates, device, a.quick) or {"ok": False}
    result["head_kernel"] = sec.run("head_kernel", budget["head_kernel"], head_kernel, device, a.quick) or {"ok": False}
    if "skipped" in result["head_kernel"]:
        log(f"head kernel: skipped ({result['head_kernel']['skipped']})")
    result["models"] = {shape: model_sections(sec, shape, a, device, dtype, peak) for shape in models}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    result["sections"] = sec.record
    result["ok"] = (bool(result["gates"].get("ok")) and all(v["status"] == "ok" for v in sec.record.values())
                    and ("skipped" in result["head_kernel"] or bool(result["head_kernel"].get("ok"))))
    result["wall_s"] = time.perf_counter() - T0
    log(f"done in {result['wall_s']:.0f} s: {'all gates passed' if result['ok'] else 'FAILED (see sections/gates)'}")
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
