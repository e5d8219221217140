"""The local backend: a stage's engines, trainer, sandbox and grader in its own process (the embedded
default). local_runtime.py is the `StageRuntime`, trainer.py its `PolicyTrainer` (one torch or
single-process DeepSpeed backend). Nothing here imports Ray; `sandbox.backend = "ray"` reaches the Ray
sandbox pool through runtime/ray/ only when asked for."""

from rstar2_core.runtime.local.local_runtime import LocalRuntime

__all__ = ["LocalRuntime"]
