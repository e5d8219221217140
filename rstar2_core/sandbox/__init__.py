"""The Python tool: an isolated, high-throughput execution service (docs/sandbox.md).

`make_sandbox(cfg.sandbox)` returns the local service (`backend = "local"`) or the Ray actor pool
(`backend = "ray"`); both have `await run(req)`, `await run_batch(reqs)`, `run_sync(req)`, `close()`
and work as async context managers.
"""

from __future__ import annotations

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.service import LocalSandbox, SandboxError
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

Sandbox = LocalSandbox

__all__ = ["ExecutionRequest", "ExecutionResult", "LocalSandbox", "Sandbox", "SandboxError", "Status",
           "make_sandbox"]


def make_sandbox(cfg: SandboxConfig):
    """The sandbox `cfg.backend` names. The Ray pool needs `ray.init()` (or a cluster address) first."""
    if cfg.backend == "local":
        return LocalSandbox(cfg)
    if cfg.backend == "ray":
        from rstar2_core.cluster.sandbox_pool import RaySandboxPool

        return RaySandboxPool(cfg)
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}; valid: 'local', 'ray'")
