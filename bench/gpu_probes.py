"""The measuring functions of the GPU check (bench/gpu_check.py) and of the GPU-only probes
(bench/sdpa_shapes.py, bench/head_kernel_calls.py): model shapes, the device's peak, the SFT and RL steps,
decode against `model.generate`, the DeepSpeed ZeRO-2 step, timing on a synchronised device.

Invariant: imports only torch and the standard library at module level (rstar2_core's modules lazily, inside
the functions): the GPU machine runs these files with torch + transformers and the repo copied, nothing else.
See docs/production.md, "GPU check" (what each measures, how MFU is counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

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
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936},
    "3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
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
    if device.type == "cuda":          # the update's own peak, for the memory plan (docs/first-cluster-run.md)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    m = rl_update(backend, trajs, adv, pad_id=0, micro_batch_size=min(batch, 16))
    sync(device)
    upd_s = time.perf_counter() - t
    mem = {}
    if device.type == "cuda":
        mem = {"update_mem_before_gib": base / 2**30, "update_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
               "update_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
               "update_micro_batch_tokens": min(batch, 16) * (prompt_len + new_tokens)}
    gen_tokens = sum(len(o.token_ids) for o in outs)
    seq_tokens = sum(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    return {"gen_s": gen_s, "gen_tokens_per_s": gen_tokens / gen_s, "update_s": upd_s,
            "update_tokens_per_s": seq_tokens / upd_s, "update_tokens": seq_tokens,
            "grad_norm": m["actor/grad_norm"], "engine_logprob_gap": m["actor/engine_logprob_gap"], **mem}


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


def liger_obstacles_on(device: torch.device) -> list[str]:
    """Why Liger's fused head cannot run on `device` ([] when it can), as the backends decide it."""
    from rstar2_core.models.token_logprobs import liger_obstacles

    return liger_obstacles(torch.nn.Linear(8, 8, bias=False), on_cuda=device.type == "cuda", partitioned=False)


def train_paths(model, backend, device: torch.device, quick: bool, peak: float, budget_tokens: int,
                cpu: bool = False) -> dict:
    """Issue #42's comparison on one model: the SFT step and the RL update on bench/train_step.py's
    long-tailed mix, old path (micro-batches by count, one SDPA per segment) vs new (by `budget_tokens`,
    the device's kernel: one FlexAttention call per layer on CUDA), each arm on its own rows, MFU each."""
    from train_step import PAD
    from train_step import sft_rows as mix_rows
    from train_step import trajectories as mix_trajectories

    from rstar2_core.models.packed_attention import resolve_kernel
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.sft.step import sft_update

    vocab, n = model.config.vocab_size, n_params(model)
    cap, system, seq, count = (96, 32, 256, 8) if cpu else (1024, 256, 2048, 16) if quick else (4096, 512, 8192, 48)
    budget_tokens = min(budget_tokens, 4 * seq)
    steps = 1 if quick else 2
    arms = {"old": ("segments", {"micro_batch_size": 8}, {"micro_batch_size": 2}),
            "new": (resolve_kernel("auto", device), {"micro_batch_size": None, "max_tokens_per_micro_batch": budget_tokens},
                    {"micro_batch_size": None, "max_tokens_per_micro_batch": budget_tokens})}
    out: dict = {"budget_tokens": budget_tokens, "mix": {"trajectories": count, "cap": cap, "system": system, "seq": seq}}
    before = backend.attention_kernel
    for arm, (kernel, rl_kw, sft_kw) in arms.items():
        seed0 = 0 if arm == "old" else 1000                     # each arm on its own rows
        rl_s = sft_s = 0.0
        rl_tok = sft_flop = 0.0
        backend.attention_kernel = kernel                       # what model.attention_kernel sets
        try:
            for i in range(steps + 1):
                trajs = mix_trajectories(count, cap, system, vocab, seed=seed0 + i)
                adv = [1.0 if j % 2 else -1.0 for j in range(count)]
                s = timed(lambda t=trajs, v=adv, kw=rl_kw: rl_update(backend, t, v, pad_id=PAD, prefix_len=system,
                                                                     **kw), device)
                rows = mix_rows(count, cap, system, seq, vocab, seed=seed0 + i)
                box: dict = {}
                s2 = timed(lambda r=rows, b=box, kw=sft_kw: b.update(sft_update(backend, r, pad_id=PAD, **kw)), device)
                if i:                                           # the first step compiles and warms up
                    rl_s += s
                    rl_tok += sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
                    sft_s += s2
                    sft_flop += sft_flops(model, box["sft/computed_tokens"], box["sft/label_tokens"])
        finally:
            backend.attention_kernel = before
        out[arm] = {"kernel": kernel, "rl_update_tokens_per_s": rl_tok / rl_s,
                    "rl_update_mfu": 8 * n * rl_tok / rl_s / (peak * 1e12), "sft_mfu": sft_flop / sft_s / (peak * 1e12)}
        log(f"train path {arm} ({kernel}): RL update MFU {out[arm]['rl_update_mfu']:.1%}, "
            f"SFT MFU {out[arm]['sft_mfu']:.1%}")
    out["rl_ratio"] = out["new"]["rl_update_tokens_per_s"] / out["old"]["rl_update_tokens_per_s"]
    return out


def flex_grads(device: torch.device) -> dict:
    """The flex kernel's log-probs and gradients against the per-segment kernel's on one packed RL micro-batch
    with a shared prefix (fp32, TF32 off): the check CPU cannot run (no FlexAttention backward there)."""
    from train_step import PAD
    from train_step import trajectories as mix_trajectories

    from rstar2_core.rl.logprobs import batch_logprobs, collate

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = build_model("cpu-small", device, torch.float32).train()
        batch = collate(mix_trajectories(6, 96, 24, model.config.vocab_size, seed=5), PAD, device, 24)
        got = {}
        for kernel in ("segments", "flex"):
            model.zero_grad(set_to_none=True)
            lp = batch_logprobs(model, batch, kernel=kernel)
            lp.sum().backward()
            got[kernel] = (lp.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    lp_gap = float((got["flex"][0] - got["segments"][0]).abs().max())
    grad_gap = max(float((got["flex"][1][k] - g).abs().max()) for k, g in got["segments"][1].items())
    return {"logprob_max_gap": lp_gap, "grad_max_gap": grad_gap, "ok": lp_gap <= 1e-5 and grad_gap <= 1e-5}
