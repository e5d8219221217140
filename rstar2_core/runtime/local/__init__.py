"""The local backend: a stage's engines, trainer, sandbox and grader in its own process (the embedded
default). local_runtime.py is the `StageRuntime`, trainer.py its `PolicyTrainer` (one torch or
single-process DeepSpeed backend). Nothing here imports Ray or runtime/ray/; `sandbox.backend = "ray"`
reaches the Ray sandbox pool through runtime/sandboxes.py only when asked for.
See docs/runtime.md, "The runtime seam"."""

from rstar2_core.runtime.local.local_runtime import LocalRuntime

__all__ = ["LocalRuntime"]
