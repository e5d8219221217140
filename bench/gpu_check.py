"""GPU check (issues 9, 17, 58): correctness gates and throughput of our pieces on one accelerator, <= 8 minutes
on an H200. The driver: which sections run, each under a hard time budget (SIGALRM), the gates, the JSON;
the measuring functions are in bench/gpu_probes.py, the gates in bench/gpu_gates.py.

Invariant: needs only torch + transformers (+ deepspeed, optional), as on the GPU machine: the rstar2_core
modules it imports load without prefect/ray/mlflow/pydantic/fsspec (tests/unit/infra/test_gpu_check.py).
Exit status 1 when a gate fails or a section errors or runs out of time. See docs/production.md, "GPU check".

    python bench/gpu_check.py --json                 # GPU, ~3-6 min; last line = JSON
    python bench/gpu_check.py --kernel-check --json  # GPU: only the attention kernels' start-up comparison
    python bench/gpu_check.py --cpu --quick --json   # CPU smoke test (~1 min)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))      # gpu_probes, gpu_gates

import torch
from gpu_kernel_check import kernel_check
from gpu_probes import (
    SHAPES,
    T0,
    build_model,
    decode_bench,
    deepspeed_step,
    device_peak,
    engine_variants,
    flex_grads,
    liger_obstacles_on,
    log,
    make_engine,
    matmul_tflops,
    n_params,
    rl_step,
    sft_step,
    sync,
    timed,
    train_paths,
)

# engine logprobs vs a teacher-forced forward, fp32: CUDA kernels differ between a batched decode step
# (masked, memory-efficient) and a full forward (causal), so the GPU gets more room than the CPU
LOGPROB_TOL = {"cpu": 1e-4, "cuda": 2e-3}
# Liger's fused head vs the torch path, fp32 (TF32 off): log-prob max |diff| and the gradients' relative error.
# Both compute the same fp32 logits in a different order (chunking, a fused kernel); a wrong reduction or
# upstream-gradient handling is off by O(1)
HEAD_TOL = 1e-3
# hard time budget per section, seconds. GPU: what keeps the whole check under 8 minutes on an H200
# (expected ~3-6; kernel_check compiles FlexAttention's forward and backward). CPU (the smoke test): a fresh clone JIT-builds DeepSpeed's CPU communication op
# (~3.5 minutes on the 2-core development machine) the first time.
BUDGETS = {
    "cuda": {"total": 480, "versions": 30, "matmul": 30, "gates": 90, "head_kernel": 60, "build": 60, "sft": 60,
             "rl": 90, "decode": 120, "deepspeed_zero2": 150, "train_paths": 150, "flex_grads": 60, "ipc": 60,
             "kernel_check": 180},
    "cpu": {"total": 900, "versions": 60, "matmul": 60, "gates": 240, "head_kernel": 30, "build": 60, "sft": 120,
            "rl": 120, "decode": 120, "deepspeed_zero2": 480, "train_paths": 240, "flex_grads": 60, "ipc": 60,
            "kernel_check": 120},
}


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
    # kernel_check=False: these steps measure throughput; the kernel comparison is its own section
    backend = TorchBackend(model, lr=1e-5, total_steps=100, warmup_steps=0, schedule="constant", kernel_check=False)
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
    if not a.no_train_paths:
        if shape == "3b":                  # 8K-token passes of a 3B model fit one GPU only with recompute
            model.gradient_checkpointing_enable()
        tp = sec.run(f"{shape}/train_paths", budget["train_paths"], train_paths, model, backend, device, quick or cpu,
                     peak, 8192 if shape == "3b" else 16384, cpu)
        if shape == "3b":
            model.gradient_checkpointing_disable()
        if tp:
            r["train_paths"] = tp
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
    ap.add_argument("--no-train-paths", action="store_true", help="skip the old/new training path comparison (#42)")
    ap.add_argument("--no-ipc", action="store_true", help="skip the packed vs per-tensor CUDA-IPC push (#43)")
    ap.add_argument("--kernel-check", action="store_true", help="run only the attention kernels' start-up "
                    "comparison (#58: segments vs flex, 0.5B shape, bf16, 16K-token micro-batch)")
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
    # first: the one figure no GPU session has measured yet (issue 58), before the other sections spend the budget
    result["kernel_check"] = (sec.run("kernel_check", budget["kernel_check"], kernel_check, device, a.quick)
                              or {"ok": False})
    if a.kernel_check:
        return finish(result, sec, a)
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
    result["flex_grads"] = (sec.run("flex_grads", budget["flex_grads"], flex_grads, device) or {"ok": False}
                            if device.type == "cuda" else {"skipped": "CPU FlexAttention has no backward"})
    log(f"flex kernel gradients: {json.dumps(result['flex_grads'])}")
    if not a.no_ipc:                      # before the models: the probe's consumer is a fresh process
        from ipc_probe import main as ipc_probe

        probe_args = ["--repeats", "2"] + (["--cpu", "--shape", "cpu-small"] if a.cpu else ["--shape", "1.5b"])
        result["ipc"] = sec.run("ipc", budget["ipc"], ipc_probe, probe_args) or {"ok": False}
    result["models"] = {shape: model_sections(sec, shape, a, device, dtype, peak) for shape in models}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    result["ok"] = (bool(result["gates"].get("ok"))
                    and ("skipped" in result["head_kernel"] or bool(result["head_kernel"].get("ok")))
                    and ("skipped" in result["flex_grads"] or bool(result["flex_grads"].get("ok")))
                    and ("ipc" not in result or bool(result["ipc"].get("packed", {}).get("exact"))))
    return finish(result, sec, a)


def finish(result: dict, sec: Sections, a) -> dict:
    """The sections' record, the verdict (every section ok, the kernel check passed, and what `result["ok"]`
    already says), the wall time; the JSON printed last with --json."""
    result["sections"] = sec.record
    result["ok"] = (result.get("ok", True) and all(v["status"] == "ok" for v in sec.record.values())
                    and bool(result["kernel_check"].get("ok")))
    result["wall_s"] = time.perf_counter() - T0
    log(f"done in {result['wall_s']:.0f} s: {'all gates passed' if result['ok'] else 'FAILED (see sections/gates)'}")
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
