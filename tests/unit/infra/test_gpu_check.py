"""bench/gpu_check.py runs end to end on the CPU (`--cpu --quick --json`) with prefect, ray, mlflow, pydantic
and fsspec made unimportable (the GPU box has only torch + transformers), passes its correctness gates
and reports every figure; and the engine and the check also work under transformers 5.17 (the GPU
machine's version), in a side environment built once under $RSTAR2_HOME/cache (side_env.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from side_env import side_python

ROOT = Path(__file__).resolve().parents[3]
BLOCKED = ("prefect", "ray", "mlflow", "pydantic", "prefect_ray", "fsspec")
# None in sys.modules: `import x` raises ImportError and importlib.util.find_spec("x") is None, as when
# the package is not installed
RUNNER = f"""
import sys, runpy
for name in {BLOCKED!r}:
    sys.modules[name] = None
sys.argv = ["bench/gpu_check.py", "--cpu", "--quick", "--json"]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""
SECTIONS = {"versions", "matmul", "gates", "head_kernel", "ipc", "cpu-small/build", "cpu-small/sft", "cpu-small/rl",
            "cpu-small/decode", "cpu-small/deepspeed_zero2", "cpu-small/train_paths", "kernel_check"}


def _check_gates(out: dict) -> None:
    g = out["gates"]
    assert g["ok"] and g["rng"]["ok"] and g["logprobs"]["ok"] and g["logprobs"]["max_abs_diff"] <= 1e-4
    variants = g["greedy"]["variants"]
    assert set(variants) == {"engine", "engine_static"}
    assert all(v["exact"] + v["near_ties"] == g["greedy"]["prompts"] and not v["wrong"] for v in variants.values())
    shared = g["greedy_shared_prefix"]
    assert shared["ok"] and shared["variants"]["engine"]["shared_prefix_steps"] > 0
    assert shared["variants"]["engine"]["exact"] + shared["variants"]["engine"]["near_ties"] == shared["prompts"]


@pytest.mark.slow
def test_gpu_check_cpu_smoke():
    proc = subprocess.run([sys.executable, "-c", RUNNER], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["device"] == "cpu" and out["peak_source"] == "measured matmul" and out["peak_tflops"] > 0
    v = out["versions"]
    assert v["torch"].startswith("2.") and v["transformers"].startswith("5.") and v["date_utc"]
    assert set(out["sections"]) == SECTIONS
    assert all(s["status"] == "ok" and 0 <= s["s"] <= s["budget_s"] for s in out["sections"].values())
    _check_gates(out)
    r = out["models"]["cpu-small"]
    assert r["params"] > 100_000
    for key in ("tokens_per_s", "mfu", "step_s"):
        assert r["sft"][key] > 0 and math.isfinite(r["sft"][key])
    assert r["rl"]["gen_tokens_per_s"] > 0 and r["rl"]["update_mfu"] > 0 and math.isfinite(r["rl"]["grad_norm"])
    assert r["rl"]["update_tokens"] == 4 * (16 + 8)
    d = r["decode"]
    assert d["generate_tokens_per_s"] > 0 and d["engine_tokens_per_s"] > 0 and d["engine_decode_ms_per_step"] > 0
    assert d["engine_vs_generate"] == pytest.approx(d["engine_tokens_per_s"] / d["generate_tokens_per_s"])
    z = r["deepspeed_zero2"]
    # DeepSpeed imports pydantic, which the box imitated here lacks: the section can only say so (it trains in
    # test_the_deepspeed_section_trains_where_deepspeed_imports)
    assert z == {"skipped": "deepspeed not installed"}, z
    assert "not on a CUDA device" in out["head_kernel"]["skipped"] and r["head_kernel"] == "torch"
    tp = r["train_paths"]                       # issue 42's old/new paths: CPU keeps the per-segment kernel
    assert tp["old"]["kernel"] == tp["new"]["kernel"] == "segments" and "skipped" in out["flex_grads"]
    assert all(tp[a][k] > 0 for a in ("old", "new") for k in ("rl_update_mfu", "sft_mfu")) and tp["rl_ratio"] > 0
    kc = out["kernel_check"]                    # issue 58's start-up comparison: its wiring, flex skipped on the CPU
    assert kc["ok"] and kc["candidate"] == "segments" and "no backward" in kc["flex"]
    assert all(kc[s]["passed"] == 1.0 and kc[s]["grad_norm"] > 0 and kc[s]["loss_rel_diff"] == 0 for s in ("sft", "rl"))
    ipc = out["ipc"]                            # issue 43's push probe: shared memory here, CUDA IPC on a GPU
    assert ipc["packed"]["exact"] and ipc["per_tensor"]["exact"] and ipc["tensors"] > 10
    assert "[" in proc.stdout.splitlines()[0]  # per-section progress lines come first


def test_a_section_over_budget_is_stopped_and_reported():
    mod = _load_gpu_check()
    import time

    sec = mod.Sections(total_budget_s=60)
    assert sec.run("slow", 1, time.sleep, 5) is None
    assert sec.run("fast", 10, lambda: 7) == 7
    assert sec.record["slow"]["status"].startswith("timeout") and sec.record["slow"]["s"] < 3
    assert sec.record["fast"]["status"] == "ok"
    spent = mod.Sections(total_budget_s=0)
    assert spent.run("late", 10, lambda: 1) is None and spent.record["late"]["status"].startswith("skipped")


@pytest.mark.slow
def test_engine_and_gpu_check_under_transformers_5_17():
    """The engine's tests and the GPU check's CPU mode, run by a Python with transformers 5.17 installed
    (the GPU machine's version, which takes the KV cache as `past_key_values`)."""
    py = side_python("transformers-5.17", ["transformers==5.17.*", "pytest", "pydantic", "numpy", "psutil"])
    ver = subprocess.run([str(py), "-c", "import transformers; print(transformers.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert ver.startswith("5.17."), ver
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONDONTWRITEBYTECODE": "1"}
    tests = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/unit/rollout/test_rollout_hf_engine.py",
                            "tests/unit/rollout/test_rollout_engine_step.py"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    proc = subprocess.run([str(py), "bench/gpu_check.py", "--cpu", "--quick", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["versions"]["transformers"] == ver
    _check_gates(out)
    assert out["models"]["cpu-small"]["rl"]["gen_tokens_per_s"] > 0


def _load_gpu_check():
    sys.path.insert(0, str(ROOT))
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_deepspeed_section_trains_where_deepspeed_imports(dist_env):
    """The section the smoke test can only see skipped (no pydantic there), where DeepSpeed imports (the dev
    extra): ZeRO-2 steps of the tiny shape on the CPU, timed."""
    _load_gpu_check()                     # puts bench/ on sys.path
    import gpu_probes

    model = gpu_probes.build_model("tiny", torch.device("cpu"), torch.float32)
    out = gpu_probes.deepspeed_step(model, 1e-5, 2, 32, 2, torch.device("cpu"))
    assert "skipped" not in out and out["step_s"] > 0 and out["tokens_per_s"] > 0, out


def test_peak_table_lookup():
    _load_gpu_check()                     # puts bench/ on sys.path
    import gpu_probes as mod
    assert mod.PEAK_TFLOPS["H200"] == 989.0
    import torch

    assert mod.device_peak(torch.device("cpu"), 1.5) == (1.5, "measured matmul")


class _ScalarUpstream(torch.autograd.Function):
    """Per-token NLL whose backward takes the upstream gradient as one scalar (its first element): the
    `reduction="none"` bug of older Liger releases, which the gate exists to catch."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            nll = F.cross_entropy(h @ w.T, targets, reduction="none")
            gh, gw = torch.autograd.grad(nll.sum(), (h, w))
        ctx.save_for_backward(gh, gw)
        return nll.detach()

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return gh * grad_out[0], gw * grad_out[0], None


def _stand_in(monkeypatch, fused):
    """Liger's entry point replaced on this CPU (the Triton kernels need CUDA): the gate's own arithmetic is
    what is tested here; the real kernel is checked on a GPU by bench/gpu_check.py."""
    from rstar2_core.models import token_logprobs as tl

    monkeypatch.setattr(tl, "_liger", lambda: fused)
    monkeypatch.setattr(tl, "liger_obstacles", lambda *a, **k: [])


def test_the_head_kernel_gate_passes_a_kernel_with_the_same_gradients(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_gates

    from rstar2_core.models import token_logprobs as tl

    _stand_in(monkeypatch, lambda h, w, t, reduction="none": F.cross_entropy(h @ w.T, t, reduction=reduction))
    monkeypatch.setattr(tl, "CHUNK_ELEMENTS", 512 * 16)    # 16-token chunks: the torch side checkpoints, as on a GPU
    out = gpu_gates.head_kernel_gate(torch.device("cpu"), 64, 512, 200, tol=1e-4)
    assert out["ok"] and out["logprob_max_abs_diff"] < 1e-5 and out["grad_weight_rel_err"] < 1e-5


def test_the_head_kernel_gate_fails_a_kernel_that_takes_the_upstream_gradient_as_a_scalar(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_gates

    _stand_in(monkeypatch, lambda h, w, t, reduction="none": _ScalarUpstream.apply(h, w, t))
    out = gpu_gates.head_kernel_gate(torch.device("cpu"), 64, 512, 200, tol=1e-3)
    assert not out["ok"] and out["logprob_max_abs_diff"] < 1e-5      # the values agree; the gradients do not
    assert out["grad_hidden_rel_err"] > 0.5 and out["grad_weight_rel_err"] > 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the probes run (minutes)")
@pytest.mark.parametrize("probe", ["sdpa_shapes.py", "head_kernel_calls.py"])
def test_the_gpu_probes_refuse_a_machine_without_cuda(probe):
    proc = subprocess.run([sys.executable, f"bench/{probe}", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr, proc.stderr[-2000:]
