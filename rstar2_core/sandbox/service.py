"""The local sandbox service: warm template processes on this host, a dispatcher thread, and the
async API the rollout loop uses (`await sandbox.run(req)`, `await sandbox.run_batch(reqs)`), plus
`run_sync`/`run_many_sync` for scripts.

Design (measured in bench/sandbox.py, see docs/sandbox.md):
- Two kinds of template (`template.py`): *light* preloads only the standard-library part of
  `cfg.preload`; *heavy* preloads all of it (sympy, numpy). A fork costs about twice as much from the
  heavy one, so code is routed by a word match on `cfg.heavy_modules` (`import sympy` -> heavy).
- At most `workers` calls run at once on this host (0 = two per CPU core); more wait in a FIFO queue.
  Each kind has ceil(workers / 4) templates (a template forks serially; more than one keeps forks
  from being the bottleneck on big hosts); a call goes to the least-loaded one.
- One dispatcher thread owns the template pipes (non-blocking, length-prefixed pickles), so the
  service works from any event loop or thread; results reach asyncio via call_soon_threadsafe.
- A template that dies (or stops answering for timeout + 10 s) is killed and restarted; calls it had
  in flight are retried once, then answered `internal`.
- `close()` (also run by garbage collection and at interpreter exit) stops every template; each
  template kills its children, and children die with their template (PR_SET_PDEATHSIG).

Departure from the paper/code-judge: no Redis/HTTP hop and no fresh interpreter per call; the
isolation is stronger (PID/network namespaces, per-call uid) than code-judge's rlimits only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import logging
import math
import os
import pickle
import re
import selectors
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

TEMPLATE_PATH = str(Path(__file__).with_name("template.py"))
log = logging.getLogger("rstar2.sandbox")
HUNG_GRACE_S = 10.0        # a template silent this long past a call's timeout is declared hung
START_TIMEOUT_S = 120.0
MAX_QUICK_RESTARTS = 5     # consecutive template deaths before hello: give up on that kind


class SandboxError(RuntimeError):
    """The service itself could not start or was used after close()."""


def default_workers(cfg: SandboxConfig) -> int:
    if cfg.workers:
        return cfg.workers
    try:
        return 2 * max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return 2 * max(1, os.cpu_count() or 1)


def _result(req_id: str, status: Status, stderr: str = "", duration_s: float = 0.0) -> ExecutionResult:
    return ExecutionResult(id=req_id, status=status, stdout="", stderr=stderr, exit_code=None,
                           duration_s=duration_s, truncated=False)


def validate(req: object) -> str | None:
    """Why `req` cannot be run (None when it can)."""
    if not isinstance(req, ExecutionRequest):
        return f"expected an ExecutionRequest, got {type(req).__name__}"
    for name in ("code", "stdin", "id"):
        if not isinstance(getattr(req, name), str):
            return f"field {name!r} must be a string, got {type(getattr(req, name)).__name__}"
    return None


@dataclass(eq=False)
class _Call:
    cid: int
    req: ExecutionRequest
    kind: str
    done: Callable[[ExecutionResult], None]
    t_submit: float
    retried: bool = False
    t_sent: float = 0.0


@dataclass(eq=False)
class _Template:
    kind: str
    index: int
    proc: subprocess.Popen
    wfd: int
    rfd: int
    outbuf: bytearray = field(default_factory=bytearray)
    inbuf: bytearray = field(default_factory=bytearray)
    inflight: dict = field(default_factory=dict)   # cid -> _Call
    hello: dict | None = None
    dead: bool = False


class _Dispatcher:
    """Everything that touches the templates; runs in its own thread."""

    def __init__(self, cfg: SandboxConfig, workers: int):
        self.cfg, self.workers = cfg, workers
        self.inbox: collections.deque[_Call] = collections.deque()
        self.queue: collections.deque[_Call] = collections.deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.templates: dict[str, list[_Template]] = {}
        self.quick_deaths: collections.Counter = collections.Counter()
        self.failed_kinds: dict[str, str] = {}
        _remove_stale_workdirs()
        self.workdir = tempfile.mkdtemp(prefix=f"rstar2-sbx-{os.getpid()}-")
        os.chmod(self.workdir, 0o711)   # per-call uids may enter their own directory, not list others
        self.inflight = 0
        self.stopping = False
        self.started = threading.Event()
        self.start_error: str | None = None
        self.stats = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=20000)
        self.thread = threading.Thread(target=self._main, name="rstar2-sandbox", daemon=True)
        light = [m for m in cfg.preload if m.split(".")[0] in sys.stdlib_module_names]
        self.preload = {"light": light, "heavy": list(cfg.preload)}
        self.kinds = ["light", "heavy"] if set(light) != set(cfg.preload) else ["light"]
        words = [re.escape(m) for m in cfg.heavy_modules]
        self.heavy_re = re.compile(r"\b(?:{})\b".format("|".join(words))) if words and "heavy" in self.kinds else None
        self.n_per_kind = max(1, math.ceil(workers / 4))

    # ---------------------------------------------------------------------------- other threads
    def submit(self, call: _Call) -> None:
        self.inbox.append(call)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # a wake-up is already pending

    def stop(self) -> None:
        self.stopping = True
        try:
            os.write(self.wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=15)

    # ---------------------------------------------------------------------------- the thread
    def _main(self) -> None:
        try:
            for kind in self.kinds:
                self.templates[kind] = [self._spawn(kind, i) for i in range(self.n_per_kind)]
            self._loop()
        except BaseException as e:
            self.start_error = self.start_error or f"sandbox dispatcher crashed: {type(e).__name__}: {e}"
            self.started.set()
            raise
        finally:
            self._shutdown()

    def _spawn(self, kind: str, index: int) -> _Template:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        # Services on one host (CLI, trainer, Ray actors) get disjoint uid blocks, keyed by their pid.
        block = 2 * self.n_per_kind * self.workers
        base = (self.cfg.uid_base + (os.getpid() % 10007) * block
                + (self.kinds.index(kind) * self.n_per_kind + index) * self.workers)
        settings = {"kind": kind, "index": index, "preload": self.preload[kind], "slots": self.workers,
                    "uid_base": base, "workdir": self.workdir, "network": self.cfg.network, "namespaces": self.cfg.namespaces,
                    "scratch_mb": self.cfg.scratch_mb,
                    "ctrl_in": to_r, "ctrl_out": from_w, "parent_pid": os.getpid()}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": self.workdir,
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", TEMPLATE_PATH, json.dumps(settings)], pass_fds=(to_r, from_w),
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.workdir)
        os.close(to_r)
        os.close(from_w)
        for fd in (to_w, from_r):
            os.set_blocking(fd, False)
        t = _Template(kind, index, proc, to_w, from_r)
        self.sel.register(from_r, selectors.EVENT_READ, t)
        self.stats["sandbox/template_starts"] += 1
        return t

    def _loop(self) -> None:
        while not self.stopping:
            self._schedule()
            events = self.sel.select(timeout=1.0)
            for key, mask in events:
                if key.data is None:
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    while self.inbox:
                        self.queue.append(self.inbox.popleft())
                elif key.fd == key.data.rfd:
                    self._read(key.data)
                else:
                    self._flush(key.data)
            self._check_hung()

    def _schedule(self) -> None:
        while self.queue and self.inflight < self.workers:
            call = self.queue.popleft()
            if call.kind in self.failed_kinds:
                self._finish(call, _result(call.req.id, Status.INTERNAL, self.failed_kinds[call.kind]))
                continue
            t = min((t for t in self.templates[call.kind] if not t.dead), key=lambda t: len(t.inflight))
            self.inflight += 1
            t.inflight[call.cid] = call
            call.t_sent = time.monotonic()
            c = self.cfg
            msg = {"cid": call.cid, "code": call.req.code, "stdin": call.req.stdin, "timeout_s": c.timeout_s,
                   "cpu_s": c.cpu_time_s, "memory_mb": c.memory_mb, "nproc": c.max_processes,
                   "fsize_mb": c.file_size_mb, "max_chars": c.max_output_chars, "mode": c.output_mode,
                   "drain_bytes": int(c.output_drain_mb * (1 << 20))}
            self._send(t, msg)

    def _send(self, t: _Template, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        had = bool(t.outbuf)
        t.outbuf += struct.pack(">I", len(data)) + data
        if not had:
            self._flush(t)

    def _flush(self, t: _Template) -> None:
        if t.dead:
            return
        try:
            while t.outbuf:
                n = os.write(t.wfd, t.outbuf)
                del t.outbuf[:n]
        except BlockingIOError:
            pass
        except BrokenPipeError:
            self._template_died(t, "its control pipe broke")
            return
        registered = self.sel.get_map().get(t.wfd) is not None
        if t.outbuf and not registered:
            self.sel.register(t.wfd, selectors.EVENT_WRITE, t)
        elif not t.outbuf and registered:
            self.sel.unregister(t.wfd)

    def _read(self, t: _Template) -> None:
        try:
            while True:
                data = os.read(t.rfd, 1 << 20)
                if not data:
                    self._template_died(t, "it exited")
                    return
                t.inbuf += data
        except BlockingIOError:
            pass
        while len(t.inbuf) >= 4:
            (n,) = struct.unpack(">I", t.inbuf[:4])
            if len(t.inbuf) < 4 + n:
                break
            msg = pickle.loads(bytes(t.inbuf[4:4 + n]))
            del t.inbuf[:4 + n]
            if msg.get("hello"):
                t.hello = msg
                self.quick_deaths[t.kind] = 0
                if not self.started.is_set() and all(x.hello for ts in self.templates.values() for x in ts):
                    self.started.set()
                continue
            call = t.inflight.pop(msg["cid"], None)
            if call is None:
                continue
            self.inflight -= 1
            if msg["status"] == "internal" and not call.retried:
                call.retried = True
                self.queue.appendleft(call)
                continue
            self._finish(call, ExecutionResult(
                id=call.req.id, status=Status(msg["status"]), stdout=msg["stdout"], stderr=msg["stderr"],
                exit_code=msg["exit_code"], duration_s=msg["duration_s"], truncated=msg["truncated"]))

    def _finish(self, call: _Call, res: ExecutionResult) -> None:
        self.stats["sandbox/calls"] += 1
        self.stats[f"sandbox/status/{res.status.value}"] += 1
        self.latencies.append(time.monotonic() - call.t_submit)
        try:
            call.done(res)
        except Exception:  # noqa: BLE001 - a caller's callback must not take the service down
            self.stats["sandbox/callback_errors"] += 1

    def _template_died(self, t: _Template, why: str) -> None:
        if t.dead:
            return
        t.dead = True
        for fd in (t.rfd, t.wfd):
            if self.sel.get_map().get(fd) is not None:
                self.sel.unregister(fd)
            os.close(fd)
        if t.proc.poll() is None:
            t.proc.kill()
        t.proc.wait()
        self.stats["sandbox/template_deaths"] += 1
        if self.stopping:
            return
        if t.hello is None:
            self.quick_deaths[t.kind] += 1
        msg = f"sandbox {t.kind} template died ({why}, exit {t.proc.returncode})"
        if not self.started.is_set() or self.quick_deaths[t.kind] >= MAX_QUICK_RESTARTS:
            self.failed_kinds[t.kind] = msg + " before it started"
            if not self.started.is_set():
                self.start_error = self.failed_kinds[t.kind]
                self.started.set()
        else:
            self.templates[t.kind][t.index] = self._spawn(t.kind, t.index)
        for call in sorted(t.inflight.values(), key=lambda c: c.cid, reverse=True):
            self.inflight -= 1
            if call.retried:
                self._finish(call, _result(call.req.id, Status.INTERNAL, msg + " twice while running this call"))
            else:
                call.retried = True
                self.queue.appendleft(call)
        t.inflight.clear()

    def _check_hung(self) -> None:
        limit = self.cfg.timeout_s + HUNG_GRACE_S
        now = time.monotonic()
        for ts in self.templates.values():
            for t in ts:
                if not t.dead and any(now - c.t_sent > limit for c in t.inflight.values()):
                    t.proc.kill()   # its pipe then reads EOF: _template_died restarts it

    def _shutdown(self) -> None:
        self.stopping = True
        for ts in self.templates.values():
            for t in ts:
                if not t.dead:
                    try:
                        os.close(t.wfd)   # EOF tells the template to kill its children and exit
                    except OSError:
                        pass
        deadline = time.monotonic() + 5.0
        for ts in self.templates.values():
            for t in ts:
                if t.dead:
                    continue
                try:
                    t.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    t.proc.kill()
                    t.proc.wait()
                os.close(t.rfd)
                t.dead = True
                for call in t.inflight.values():
                    self.queue.append(call)
        while self.inbox:
            self.queue.append(self.inbox.popleft())
        while self.queue:
            call = self.queue.popleft()
            self._finish(call, _result(call.req.id, Status.INTERNAL, "sandbox closed before this call ran"))
        self.sel.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _remove_stale_workdirs() -> None:
    """Work directories of services whose process is gone (killed before close(), e.g. by ray.kill)."""
    root = Path(tempfile.gettempdir())
    for d in root.glob("rstar2-sbx-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class LocalSandbox:
    """The Sandbox of docs/CONTRACTS.md on this host. Use as `async with`, `with`, or call close()."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.workers = default_workers(cfg)
        self._d: _Dispatcher | None = None
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
            d = _Dispatcher(self.cfg, self.workers)
            self._finalizer = weakref.finalize(self, d.stop)
            d.thread.start()
            if not d.started.wait(START_TIMEOUT_S):
                d.start_error = f"sandbox templates did not start within {START_TIMEOUT_S:.0f} s"
            if d.start_error:
                d.stop()
                self._closed = True
                raise SandboxError(d.start_error + "; run `rstar2 sandbox doctor` to see what this host allows")
            self._d = d
            f = next(iter(d.templates.values()))[0].hello["features"]
            log.info("sandbox up: %d workers, templates %s; netns=%s pidns=%s per-call uid=%s%s", self.workers,
                     "+".join(d.templates), f["netns"], f["pidns"], f["uid_drop"],
                     "".join(f"; {n}" for n in f["notes"]))
            return self

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
    def _dispatcher(self) -> _Dispatcher:
        if self._d is None:
            self.start()
        if self._closed:
            raise SandboxError("this sandbox was closed; make a new one with make_sandbox(cfg)")
        return self._d

    def submit(self, req: ExecutionRequest, done: Callable[[ExecutionResult], None]) -> None:
        """Run `req`; `done(result)` is called from the dispatcher thread."""
        why = validate(req)
        if why is not None:
            done(_result(getattr(req, "id", "") if isinstance(getattr(req, "id", ""), str) else "",
                         Status.INVALID_REQUEST, why))
            return
        d = self._dispatcher()
        kind = "heavy" if d.heavy_re is not None and d.heavy_re.search(req.code) else "light"
        d.submit(_Call(next(self._ids), req, kind, done, time.monotonic()))

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

