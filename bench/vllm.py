"""`python bench/vllm.py [--quick] [--json] [--model URL]`: the vLLM benchmark, whose code and documentation
are in bench/vllm_bench.py.

This file has the name of the package it measures, and Python puts a script's folder first on `sys.path`:
for every script in bench/ (and every process that put bench/ on its path), `import vllm` finds this file
first. Imported that way (`__name__ == "vllm"`) it hands the import over to the real vLLM package, so that
name cannot shadow it; run as a script it runs the benchmark.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _without_this_folder() -> list[str]:
    return [p for p in sys.path if Path(p or ".").resolve() != _HERE]


if __name__ == "vllm":
    saved = sys.path[:]
    sys.path[:] = _without_this_folder()
    del sys.modules["vllm"]
    try:
        _real = importlib.import_module("vllm")
    finally:
        sys.path[:] = saved
    sys.modules["vllm"] = _real          # what `import vllm` returns once this file has run
elif __name__ in ("__main__", "__mp_main__"):
    sys.path[:] = _without_this_folder()     # vLLM's spawned processes re-run this file as __mp_main__
    spec = importlib.util.spec_from_file_location("vllm_bench", _HERE / "vllm_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if __name__ == "__main__":
        bench.main()
