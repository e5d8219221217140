"""bench/gpu_check.py runs end to end on the CPU (`--cpu --quick --json`) with prefect, ray, mlflow and
pydantic made unimportable (the GPU box has only torch + transformers), and reports every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BLOCKED = ("prefect", "ray", "mlflow", "pydantic", "prefect_ray")
# None in sys.modules: `import x` raises ImportError and importlib.util.find_spec("x") is None, as when
# the package is not installed
RUNNER = f"""
import sys, runpy
for name in {BLOCKED!r}:
    sys.modules[name] = None
sys.argv = ["bench/gpu_check.py", "--cpu", "--quick", "--json"]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_check_cpu_smoke():
    proc = subprocess.run([sys.executable, "-c", RUNNER], cwd=ROOT, capture_output=True, text=True, timeout=800,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["peak_source"] == "measured matmul" and out["peak_tflops"] > 0
    r = out["models"]["cpu-small"]
    assert r["params"] > 100_000
    for key in ("tokens_per_s", "mfu", "step_s"):
        assert r["sft"][key] > 0 and math.isfinite(r["sft"][key])
    assert r["rl"]["gen_tokens_per_s"] > 0 and r["rl"]["update_mfu"] > 0 and math.isfinite(r["rl"]["grad_norm"])
    assert r["rl"]["update_tokens"] == 4 * (16 + 8)
    d = r["decode"]
    assert d["generate_tokens_per_s"] > 0 and d["engine_tokens_per_s"] > 0
    assert d["engine_vs_generate"] == pytest.approx(d["engine_tokens_per_s"] / d["generate_tokens_per_s"])
    z = r["deepspeed_zero2"]
    assert "skipped" in z or (z["tokens_per_s"] > 0 and z["vs_torch"] > 0)
    assert "[" in proc.stdout.splitlines()[0]  # per-section progress lines come first


def test_peak_table_lookup():
    sys.path.insert(0, str(ROOT))
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.PEAK_TFLOPS["H200"] == 989.0
    import torch

    assert mod.device_peak(torch.device("cpu"), 1.5) == (1.5, "measured matmul")
