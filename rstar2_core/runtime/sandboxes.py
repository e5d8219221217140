"""The sandbox a runtime opens: the local service in this process, or the Ray actor pool over a cluster.

`sandbox.backend = "ray"` gives the local runtime the same actor pool the Ray runtime places on its
layout's sandbox bundles; this module is where a runtime reaches it, so the local backend (runtime/local/)
imports nothing from runtime/ray/. Invariant: the Ray pool's modules load only inside
`ray_sandbox_pool`, so opening a local sandbox never imports Ray.
See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rstar2_core.config import ClusterConfig, SandboxConfig


def local_sandbox(cfg: SandboxConfig) -> Any:
    """The sandbox service forked in this process (`LocalSandbox`), not yet entered."""
    from rstar2_core.sandbox import LocalSandbox

    return LocalSandbox(cfg)


def ray_sandbox_pool(cfg: SandboxConfig, *, cluster: ClusterConfig | None = None,
                     placements: list[tuple] | None = None) -> Any:
    """The sandbox actor pool (`RaySandboxPool`): one actor per `placements` entry (placement group, bundle
    index, CPUs), or without them `sandbox.ray_actors_per_node` actors on every live node. `cluster`:
    connect to (or start) the Ray of that section first."""
    from rstar2_core.runtime.ray.connect import ensure_ray
    from rstar2_core.runtime.ray.sandbox_pool import RaySandboxPool

    if cluster is not None:
        ensure_ray(cluster)
    return RaySandboxPool(cfg, placements=placements)
