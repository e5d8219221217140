"""bench/vllm.py has the name of the package it measures: with bench/ on `sys.path` (any script in bench/,
or a module that put it there), `import vllm` must still give the real vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_import_vllm_with_bench_on_the_path_finds_the_real_package():
    code = ("import sys; sys.path.insert(0, 'bench'); import vllm, vllm.sampling_params; "
            "print(vllm.__file__); print(vllm.__version__); import learning")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    path, version = out.stdout.split()[-2:]
    assert "site-packages" in path and version.startswith("0.32.")
