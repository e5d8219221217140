"""The Ray backend, the only place in rstar2_core that imports Ray.

- ray_runtime.py: `RayRuntime`, the `StageRuntime` on a Ray cluster;
- placement.py (placement groups from runtime/layout.py, actor start and death) -> engine_actors.py,
  trainer_shards.py (+ sharding.py: token-balanced items per rank), sandbox_pool.py;
- weight_sync.py: trainer -> engines (object store, checkpoint reload, vLLM NCCL / IPC);
- connect.py: `ray.init` settings shared with the pipeline's task runner; errors.py: the actor errors and
  the one list of Ray's own infrastructure errors; node_kill.py: the `kill-node` fault's raylet kill;
- rehearsal/: the local multi-node cluster harness (`rstar2 cluster up`), which no runtime imports.
Importing this package imports no Ray (names load on first use); errors.py and connect.py import Ray
only inside the functions that need it, so the pipeline's retry rule can use them anywhere.
"""

from rstar2_core.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"RayRuntime": "ray_runtime", "RaySandboxPool": "sandbox_pool"})
__all__ = ["RayRuntime", "RaySandboxPool"]
