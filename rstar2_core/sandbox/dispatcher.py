"""The dispatcher of the local sandbox service: one thread that owns the template processes (start,
restart, shutdown) and their pipes, keeps at most `workers` calls running and the rest in a FIFO
queue, and hands each result to the caller's callback. `service.LocalSandbox` is its public face.

Invariant: no template runs a call with less isolation than the service allows: a template whose
hello reports a property missing that `cfg.allow_missing_isolation` does not name is stopped and its
kind fails (at start-up: the service does not start). The root's plan (`rootfs.plan_root`) and the
compiled seccomp program (`syscalls.compile_filter`) are computed here once, for every template.
See docs/sandbox.md, "How it works" (Dispatcher), and docs/sandbox-isolation.md, "Fail closed".
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.confined.sbx_frames import frame, unframe
from rstar2_core.sandbox.properties import missing, properties
from rstar2_core.sandbox.rootfs import plan_root
from rstar2_core.sandbox.syscalls import compile_filter
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

TEMPLATE_PATH = str(Path(__file__).with_name("template.py"))
HUNG_GRACE_S = 10.0        # a template silent this long past a call's timeout is declared hung
MAX_QUICK_RESTARTS = 5     # consecutive template deaths before hello: give up on that kind


def internal_result(req_id: str, status: Status, stderr: str = "", duration_s: float = 0.0) -> ExecutionResult:
    return ExecutionResult(id=req_id, status=status, stdout="", stderr=stderr, exit_code=None,
                           duration_s=duration_s, truncated=False)


@dataclass(eq=False)
class Call:
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
    inflight: dict = field(default_factory=dict)   # cid -> Call
    hello: dict | None = None
    dead: bool = False


class Dispatcher:
    """Everything that touches the templates; runs in its own thread. `confine`: build the minimal
    root and install the seccomp filter (False only to measure what they cost, bench/sandbox.py)."""

    def __init__(self, cfg: SandboxConfig, workers: int, confine: bool = True):
        self.cfg, self.workers, self.confine = cfg, workers, confine
        self.inbox: collections.deque[Call] = collections.deque()
        self.queue: collections.deque[Call] = collections.deque()
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
        self.root_plan = plan_root(tuple(dict.fromkeys([*cfg.preload, *cfg.heavy_modules]))) if confine else None
        self.seccomp = compile_filter() if confine else None

    # ---------------------------------------------------------------------------- other threads
    def submit(self, call: Call) -> None:
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
                    "scratch_mb": self.cfg.scratch_mb, "confine": self.confine,
                    "root_plan": self.root_plan.to_settings() if self.root_plan else None,
                    "seccomp_bpf": self.seccomp.bpf.hex() if self.seccomp and self.seccomp.bpf else "",
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
                self._finish(call, internal_result(call.req.id, Status.INTERNAL, self.failed_kinds[call.kind]))
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
        had = bool(t.outbuf)
        t.outbuf += frame(msg)
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
        for msg in unframe(t.inbuf):
            if msg.get("hello"):
                refusal = self._isolation_refusal(msg["features"])
                if refusal:   # fail closed: no call runs with less isolation than allowed
                    self.failed_kinds[t.kind] = refusal
                    if not self.started.is_set():
                        self.start_error = refusal
                        self.started.set()
                    self._template_died(t, "its calls would lack isolation properties")
                    return
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
                exit_code=msg["exit_code"], duration_s=msg["duration_s"], truncated=msg["truncated"],
                cpu_s=msg.get("cpu_s")))

    def _finish(self, call: Call, res: ExecutionResult) -> None:
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
        # A failed kind is not restarted: _schedule answers its calls with the reason.
        if t.kind not in self.failed_kinds:
            if not self.started.is_set() or self.quick_deaths[t.kind] >= MAX_QUICK_RESTARTS:
                self.failed_kinds[t.kind] = msg + " before it started"
                if not self.started.is_set():
                    self.start_error = self.failed_kinds[t.kind]
                    self.started.set()
            else:
                self.templates[t.kind][t.index] = self._spawn(t.kind, t.index)
        for call in sorted(t.inflight.values(), key=lambda c: c.cid, reverse=True):
            self.inflight -= 1
            if call.retried and t.kind not in self.failed_kinds:   # a failed kind: _schedule gives the reason
                self._finish(call, internal_result(call.req.id, Status.INTERNAL, msg + " twice while running this call"))
            else:
                call.retried = True
                self.queue.appendleft(call)
        t.inflight.clear()

    def _isolation_refusal(self, features: dict) -> str | None:
        """Why a template with these `features` must not run calls: the isolation properties its calls
        would lack that `cfg.allow_missing_isolation` does not name (None when there are none, or when
        confinement is off for a measurement)."""
        if not self.confine:
            return None
        lacking = missing(features, self.seccomp.why if self.seccomp else "", self.cfg.allow_missing_isolation)
        if not lacking:
            return None
        names = [n for n, ok in properties(features).items() if not ok]
        notes = "; ".join(features.get("notes") or [])
        return (f"sandbox isolation MISSING on this host, so the service refuses to run calls: {'; '.join(lacking)}"
                + (f" (the template found: {notes})" if notes else "")
                + ". Fix the host (run the service as root where namespaces are allowed, e.g. a container with "
                  "CAP_SYS_ADMIN and seccomp=unconfined; the system's libseccomp2 and pyseccomp for the filter), "
                  f"or accept weaker isolation with sandbox.allow_missing_isolation = {names!r}")

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
            self._finish(call, internal_result(call.req.id, Status.INTERNAL, "sandbox closed before this call ran"))
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
