"""The Python tool: an isolated, high-throughput execution service (docs/sandbox.md).

`make_sandbox(cfg.sandbox)` returns the local service; it has `await run(req)`, `await run_batch(reqs)`,
`run_sync(req)`, `close()` and works as an async context manager. The Ray actor pool
(`sandbox.backend = "ray"`, rstar2_core/runtime/ray/sandbox_pool.py) has the same API and is opened by the
stage's runtime (`rstar2_core.runtime.open_runtime`), which sits above this package.
"""

from __future__ import annotations

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.service import LocalSandbox, SandboxError
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

Sandbox = LocalSandbox

__all__ = ["ExecutionRequest", "ExecutionResult", "LocalSandbox", "Sandbox", "SandboxError", "Status",
           "make_sandbox"]


def make_sandbox(cfg: SandboxConfig) -> LocalSandbox:
    """The local sandbox service of `cfg` (`backend = "local"`)."""
    if cfg.backend != "local":
        raise ValueError(f"make_sandbox builds the local service; sandbox.backend = {cfg.backend!r} is opened by the "
                         "stage's runtime (rstar2_core.runtime.open_runtime) or directly as "
                         "rstar2_core.runtime.ray.sandbox_pool.RaySandboxPool(cfg)")
    return LocalSandbox(cfg)
