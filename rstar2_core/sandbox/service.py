"""The local sandbox service: the async API the rollout loop uses (`await sandbox.run(req)`,
`await sandbox.run_batch(reqs)`), `run_sync`/`run_many_sync` for scripts, over warm template processes
on this host that the dispatcher thread (dispatcher.py) drives. At most `workers` calls run at once
(0 = two per CPU core); more wait in a FIFO queue. `close()` (also on garbage collection and at
interpreter exit) stops every template.

Invariant: it fails closed: if this host cannot provide an isolation property (properties.py) that
`cfg.allow_missing_isolation` does not name, start() raises SandboxError naming it, why, and the fix.
See docs/sandbox.md, "Use", and docs/sandbox-isolation.md, "Fail closed".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Self

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.dispatcher import Call, Dispatcher, internal_result
from rstar2_core.sandbox.properties import missing, properties
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

log = logging.getLogger("rstar2.sandbox")
START_TIMEOUT_S = 120.0


class SandboxError(RuntimeError):
    """The service itself could not start (including: this host cannot provide an isolation property
    that sandbox.allow_missing_isolation does not name) or was used after close()."""


def default_workers(cfg: SandboxConfig) -> int:
    if cfg.workers:
        return cfg.workers
    try:
        return 2 * max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return 2 * max(1, os.cpu_count() or 1)


def validate(req: object) -> str | None:
    """Why `req` cannot be run (None when it can)."""
    if not isinstance(req, ExecutionRequest):
        return f"expected an ExecutionRequest, got {type(req).__name__}"
    for name in ("code", "stdin", "id"):
        if not isinstance(getattr(req, name), str):
            return f"field {name!r} must be a string, got {type(getattr(req, name)).__name__}"
    return None


class LocalSandbox:
    """The Sandbox of docs/CONTRACTS.md on this host. Use as `async with`, `with`, or call close()."""

    def __init__(self, cfg: SandboxConfig, *, confine: bool = True):
        """`confine=False` runs calls without the minimal root, their own /tmp and /proc, per-slot
        network namespaces and the seccomp filter: only for measuring what those cost (bench/sandbox.py)."""
        self.cfg = cfg
        self.confine = confine
        self.workers = default_workers(cfg)
        self._d: Dispatcher | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle
    def start(self) -> LocalSandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("this sandbox was closed; make a new one with make_sandbox(cfg)")
            if self._d is not None:
                return self
            if self.confine and self.cfg.scratch_mb == 0:
                self._closed = True
                raise SandboxError("sandbox.scratch_mb = 0 would keep the calls' files on the host's disk, outside "
                                   "the minimal root they run in; set it > 0 (RAM for the calls' private /tmp)")
            d = Dispatcher(self.cfg, self.workers, self.confine)
            self._finalizer = weakref.finalize(self, d.stop)
            d.thread.start()
            if not d.started.wait(START_TIMEOUT_S):
                d.start_error = f"sandbox templates did not start within {START_TIMEOUT_S:.0f} s"
            if d.start_error:
                d.stop()
                self._closed = True
                raise SandboxError(d.start_error + "; run `rstar2 sandbox doctor` to see what this host allows")
            self._d = d
            self._log_isolation(d)
            return self

    def _log_isolation(self, d: Dispatcher) -> None:
        feats = [t.hello["features"] for ts in d.templates.values() for t in ts]
        f = feats[0]
        have = [k for k, ok in properties(f).items() if ok]
        log.info("sandbox up: %d workers, templates %s; isolation: %s; root %s (%d mounts)%s", self.workers,
                 "+".join(d.templates), ", ".join(have), f["minimal_root"] or "host", f["root_mounts"],
                 "".join(f"; {n}" for n in f["notes"]))
        lacking = list(dict.fromkeys(line for x in feats for line in missing(x, d.seccomp.why if d.seccomp else "")))
        if not self.confine:
            log.info("sandbox confinement off (confine=False): %d properties off", len(lacking))
        elif lacking:   # the dispatcher refused any not in cfg.allow_missing_isolation
            log.warning("sandbox isolation MISSING on this host (allowed by sandbox.allow_missing_isolation): %s "
                        "(see `rstar2 sandbox doctor`)", "; ".join(lacking))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def features(self) -> dict:
        """What the templates found this host allows (from their hello), per kind."""
        d = self._dispatcher()
        return {k: dict(ts[0].hello or {}) for k, ts in d.templates.items()}

    def stats(self) -> dict[str, float]:
        """Counters and latency percentiles under `sandbox/...` for log_metrics."""
        d = self._dispatcher()
        out = {k: float(v) for k, v in d.stats.items()}
        lat = sorted(d.latencies)
        if lat:
            out["sandbox/latency_p50_ms"] = 1e3 * lat[len(lat) // 2]
            out["sandbox/latency_p99_ms"] = 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        return out

    # -- calls
    def _dispatcher(self) -> Dispatcher:
        if self._d is None:
            self.start()
        if self._closed:
            raise SandboxError("this sandbox was closed; make a new one with make_sandbox(cfg)")
        return self._d

    def submit(self, req: ExecutionRequest, done: Callable[[ExecutionResult], None]) -> None:
        """Run `req`; `done(result)` is called from the dispatcher thread."""
        why = validate(req)
        if why is not None:
            done(internal_result(getattr(req, "id", "") if isinstance(getattr(req, "id", ""), str) else "",
                         Status.INVALID_REQUEST, why))
            return
        d = self._dispatcher()
        kind = "heavy" if d.heavy_re is not None and d.heavy_re.search(req.code) else "light"
        d.submit(Call(next(self._ids), req, kind, done, time.monotonic()))

    async def run(self, req: ExecutionRequest) -> ExecutionResult:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(res: ExecutionResult) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, fut, res)
            except RuntimeError:
                pass  # the caller's loop is gone

        self.submit(req, done)
        return await fut

    async def run_batch(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        return list(await asyncio.gather(*(self.run(r) for r in reqs)))

    def run_many_sync(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        futs = []
        for r in reqs:
            f: concurrent.futures.Future = concurrent.futures.Future()
            self.submit(r, f.set_result)
            futs.append(f)
        return [f.result() for f in futs]

    def run_sync(self, req: ExecutionRequest) -> ExecutionResult:
        return self.run_many_sync([req])[0]


def _resolve(fut: asyncio.Future, res: ExecutionResult) -> None:
    if not fut.done():
        fut.set_result(res)

