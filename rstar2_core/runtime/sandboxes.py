"""The sandbox a runtime opens: the local service in this process, the Ray actor pool over a cluster, or
a client of the tool service (`sandbox.backend = "service"`).

`sandbox.backend = "ray"` gives the local runtime the same actor pool the Ray runtime places on its
layout's sandbox bundles; this module is where a runtime reaches it, so the local backend (runtime/local/)
imports nothing from runtime/ray/. Invariant: the Ray pool's modules load only inside
`ray_sandbox_pool`, so opening a local sandbox never imports Ray.
See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

import sys
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


def service_sandbox(cfg: SandboxConfig, *, cluster: ClusterConfig | None = None) -> Any:
    """A client of the tool service, not yet entered (entering checks its health: `ToolServiceUnavailable`
    within `sandbox.service.ready_timeout_s`). `connect = "http"`, or `"auto"` with a `url` while this
    process has no Ray connection and `cluster` names no Ray address: `HttpToolService` (no Ray import).
    Otherwise Serve's in-cluster handle, connecting to `cluster`'s Ray first when given and not yet
    connected; under `"auto"` a Ray cluster that does not run the application falls back to the `url`."""
    from rstar2_core.sandbox.remote import HttpToolService

    sc = cfg.service
    ray_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    remote_ray = cluster is not None and bool(cluster.ray_address)
    if sc.connect == "http" or (sc.connect == "auto" and sc.url and not ray_up and not remote_ray):
        return HttpToolService(cfg)          # never a local Ray started only to look for the service
    from rstar2_core.runtime.ray.connect import ensure_ray
    from rstar2_core.runtime.ray.tool_service import ToolServiceHandle, tool_service_status

    if not ray_up and cluster is not None:
        ensure_ray(cluster)
    if sc.connect == "auto" and sc.url and tool_service_status(sc.app_name)["status"] == "NOT_DEPLOYED":
        return HttpToolService(cfg)
    return ToolServiceHandle(cfg)
