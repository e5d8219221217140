"""Side Python environments for version tests, built once and cached under $RSTAR2_HOME/cache/side-envs.

`side_python(name, packages)` returns the interpreter of a venv holding the project's torch (the CPU
wheel on this machine's disk: `pip install torch==<ours>` downloads nothing) plus `packages` from the
package index, e.g. another transformers release. The venv is built in a temporary folder and renamed
into place when complete, so an interrupted build is never reused; a different package list gets a
fresh one. Building transformers 5.17's took 62 s and 135 s on the 2-core development machine (load
average ~3 and ~5; torch from disk, transformers, pytest, pydantic, numpy, psutil from PyPI); later
runs reuse it. Only a package index that cannot be reached
skips the test (with that reason); any other install failure fails it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _cache_root() -> Path:
    # tests/conftest.py points RSTAR2_HOME at a per-session folder; XDG_CACHE_HOME keeps the checkout's
    # $RSTAR2_HOME/cache (scripts/env.sh sets both to the same folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or ROOT / ".rstar2" / "cache") / "side-envs"


def _torch_spec() -> str:
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def _index_reachable(url: str = "https://pypi.org/simple/pip/") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def side_python(name: str, packages: list[str]) -> Path:
    spec = [_torch_spec(), *packages]
    key = hashlib.sha256("\n".join(spec).encode()).hexdigest()[:12]
    home = _cache_root() / f"{name}-{key}"
    py = home / "bin" / "python"
    if (home / "COMPLETE").is_file() and py.exists():
        return py
    tmp = home.with_name(home.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for step in ([spec[0]], spec[1:]):          # torch first, so the rest never pulls another build
        proc = subprocess.run(pip + step, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if not _index_reachable():
                pytest.skip(f"the package index (PyPI) is unreachable, so the side environment {name} "
                            f"({' '.join(step)}) cannot be built")
            raise RuntimeError(f"pip install {' '.join(step)} failed in the side environment {name}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    (tmp / "COMPLETE").write_text("\n".join(spec) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    tmp.rename(home)
    return home / "bin" / "python"
