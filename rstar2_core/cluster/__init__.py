"""Where stages run: `open_runtime` (runtimes.py) picks the local or the Ray runtime; the Ray one and its
actors (engines, trainer shards, sandbox pool), placement and weight sync live here, the only place that
imports ray (imported lazily: `import rstar2_core.cluster` does not start or import Ray)."""

from rstar2_core.cluster.runtimes import RUNTIMES, open_runtime

__all__ = ["RUNTIMES", "open_runtime"]
