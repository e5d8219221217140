"""`GraderPool`: grade many responses in worker processes with a HARD per-item timeout.

    with GraderPool(workers=2, timeout_s=5.0) as pool:
        results = pool.grade_many([(response_text, gold), ...])   # list[GradeResult], same order

Workers are fresh `python` processes (`subprocess`, one socket pair each, dying with their parent via
`PR_SET_PDEATHSIG`); an item past its deadline gets `grader_timeout` and its worker is SIGKILLed and
replaced. Invariant: the pool never hangs on an item and never uses `signal.alarm` (RECIPE.md:
alarm-based graders fail silently in threads); concurrent `grade_many` calls are serialised.
See docs/chat-and-grading.md, "Grading".
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Self

from rstar2_core.chat.answer import extract_answer
from rstar2_core.errors import GraderUnavailable
from rstar2_core.reward.grade import GradeResult, grade_response

log = logging.getLogger(__name__)
GradeFn = Callable[[str, str], GradeResult]


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent dies, so a hung item cannot outlive a crashed
    trainer or a killed Ray actor (an idle worker exits anyway when its socket closes). The kernel
    ties this to the *thread* that spawned the worker; a worker lost because that thread ended is
    seen as a dead idle worker and replaced on the next `grade_many`."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)


def _worker_main(fd: int) -> None:
    """Entry point of a worker process: `fd` is its end of the socket pair."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    os.dup2(2, 1)  # a stray print must not land in the parent's stdout (`rstar2 grade` streams JSONL there)
    conn = Connection(fd)
    sys.path[:] = conn.recv()  # the parent's path first, so that grade_fn's module imports
    grade_fn, memory_mb = pickle.loads(conn.recv_bytes())
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Exercise the CAS path once (imports math-verify, sympy's simplify, the LaTeX parser) before saying
    # ready, so that no item is charged for ~2 s of imports.
    grade_fn("<answer>\\boxed{\\frac{x^2+1}{2}}</answer>", "x^2/2+1/2")
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        idx, response, gold = msg
        try:
            result = grade_fn(response, gold)
        except Exception as e:  # noqa: BLE001 - a grader bug on one item scores it 0; the worker lives on
            result = GradeResult(0.0, None, "grader_error")
            log.debug("grader raised on item %s: %r", idx, e)
        conn.send(("result", idx, result))


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PREFETCH = 8                  # items sent ahead to one worker
_MAX_QUEUED_CHARS = 32 * 1024  # ... totalling at most this many characters behind the head item
_WORKER_CMD = "import sys; from rstar2_core.reward.pool import _worker_main; _worker_main(int(sys.argv[1]))"


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), or None where that is not available."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def next_check(started: float, now: float, timeout_s: float, grace: float, cpu_used: float | None) -> float | None:
    """When to look at a running item again, or None to stop it now (called once `timeout_s` of wall
    time has passed). A worker that had at least half of `timeout_s` in CPU was not starved."""
    hard = started + grace * timeout_s
    if cpu_used is None or cpu_used >= 0.5 * timeout_s or now >= hard:
        return None
    return min(hard, now + max(0.05, 0.5 * timeout_s - cpu_used))


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    items: deque = field(default_factory=deque)  # sent, not yet answered; the head is being graded
    queued_chars: int = 0                        # characters of the items behind the head
    started: float = 0.0                         # when the head item started (its clock)
    deadline: float = 0.0                        # when the head item is checked next
    cpu0: float | None = None                    # the worker's CPU seconds when the head item started

    @property
    def busy(self) -> bool:
        return bool(self.items)


class GraderPool:
    """A pool of grader processes; `workers=0` means one per CPU core.

    `grade_fn` (default `grade_response`) must be a module-level function (it is pickled by reference
    into the workers, which get this process's `sys.path`); `memory_mb` caps each worker's address
    space (0 = no cap).
    An item is stopped after `timeout_s` seconds of wall time, unless its worker got less than half of
    that in CPU time (starved by other load on a shared machine, not hung): then it may run on until
    it has had that CPU, but never past `starved_grace * timeout_s` of wall time (1.0 = wall only).
    """

    def __init__(self, workers: int = 0, timeout_s: float = 5.0, *, grade_fn: GradeFn = grade_response,
                 memory_mb: int = 4096, start_timeout_s: float = 120.0, starved_grace: float = 3.0):
        if workers < 0:
            raise ValueError(f"workers={workers}: use 0 (one per CPU core) or a positive count")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: the per-item timeout must be > 0 seconds")
        self.n_workers = workers or os.cpu_count() or 1
        self.timeout_s = float(timeout_s)
        self.grade_fn = grade_fn
        self.memory_mb = memory_mb
        self.start_timeout_s = start_timeout_s
        if starved_grace < 1.0:
            raise ValueError(f"starved_grace={starved_grace}: use 1.0 (pure wall-clock timeout) or more")
        self.starved_grace = float(starved_grace)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # grade_many calls from several threads run one after the other
        self.graded = self.timeouts = self.errors = self.restarts = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if not self._workers:
            self._workers = [self._spawn() for _ in range(self.n_workers)]

    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_CMD, str(child.fileno())],
                                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()  # so that the worker's death reads as EOF here
        conn = Connection(parent.detach())
        conn.send(list(sys.path))
        conn.send_bytes(pickle.dumps((self.grade_fn, self.memory_mb)))
        return _Worker(proc, conn)

    def _kill(self, w: _Worker) -> None:
        if w.proc.poll() is None:
            w.proc.kill()
        try:
            w.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("grader worker %d did not exit after SIGKILL", w.proc.pid)
        w.conn.close()

    def _replace(self, slot: int) -> None:
        self._kill(self._workers[slot])
        self._workers[slot] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        """Stop every worker (idle ones exit cleanly, busy ones are killed)."""
        for w in self._workers:
            if not w.busy and w.proc.poll() is None:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            if not w.busy:
                try:
                    w.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._kill(w)
        self._workers = []

    # ------------------------------------------------------------------ grading
    def grade_many(self, items: list[tuple[str, str]]) -> list[GradeResult]:
        """Grade (response_text, gold) pairs; one `GradeResult` per item, in order.

        An item that is not a pair of strings gets `invalid_request` without reaching a worker.
        """
        with self._lock:
            return self._grade_many(items)

    def _grade_many(self, items: list[tuple[str, str]]) -> list[GradeResult]:
        self.start()
        for slot, w in enumerate(self._workers):
            if w.busy:  # left over from a call that was interrupted: its answers must not be mixed in
                self._replace(slot)
        results: list[GradeResult | None] = [None] * len(items)
        queue: deque[int] = deque()
        for i, item in enumerate(items):
            if (isinstance(item, (tuple, list)) and len(item) == 2
                    and isinstance(item[0], str) and isinstance(item[1], str)):
                queue.append(i)
            else:
                results[i] = GradeResult(0.0, None, "invalid_request")
        remaining = len(queue)
        idle_since = time.monotonic()
        start_failures = 0

        def size(i: int) -> int:
            return len(items[i][0]) + len(items[i][1])

        def start_clock(w: _Worker, now: float) -> None:
            w.started, w.deadline = now, now + self.timeout_s
            w.cpu0 = _cpu_seconds(w.proc.pid) if self.starved_grace > 1.0 else None

        def finish(w: _Worker, result: GradeResult, now: float) -> None:
            nonlocal remaining
            results[w.items.popleft()] = result
            remaining -= 1
            if w.items:
                w.queued_chars -= size(w.items[0])
                start_clock(w, now)

        def drop(slot: int, reason: str, now: float) -> None:
            """The head item failed (timeout or death): score it, requeue the rest, replace the worker."""
            w = self._workers[slot]
            head = w.items[0]
            finish(w, GradeResult(0.0, extract_answer(items[head][0]), reason), now)
            queue.extendleft(reversed(w.items))
            self._replace(slot)

        while remaining:
            now = time.monotonic()
            for w in self._workers:
                # Keep up to `_PREFETCH` items per worker so it never waits for this loop, but never more
                # queued characters than a socket buffer holds: a send to a hung worker must not block.
                while (w.ready and queue and len(w.items) < _PREFETCH
                       and (not w.items or w.queued_chars + size(queue[0]) <= _MAX_QUEUED_CHARS)):
                    i = queue.popleft()
                    w.conn.send((i, items[i][0], items[i][1]))
                    if w.items:
                        w.queued_chars += size(i)
                    else:
                        start_clock(w, now)
                    w.items.append(i)
            busy = [w.deadline for w in self._workers if w.busy]
            if busy:
                idle_since = now
                timeout = max(0.0, min(busy) - now)
            else:
                timeout = self.start_timeout_s - (now - idle_since)
                if timeout <= 0:
                    raise GraderUnavailable(f"no grader worker became ready within {self.start_timeout_s:.0f} s "
                                            "(an overloaded node, or math-verify does not import: check "
                                            "python -c 'import math_verify')")
            by_conn = {w.conn: k for k, w in enumerate(self._workers)}
            for conn in wait(list(by_conn), timeout=timeout):
                slot = by_conn[conn]
                w = self._workers[slot]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if w.busy:
                        self.errors += 1
                        drop(slot, "grader_error", time.monotonic())
                        continue
                    if not w.ready:
                        start_failures += 1
                        if start_failures > 2 * self.n_workers:
                            raise RuntimeError(f"grader workers die while starting (exit code "
                                               f"{w.proc.poll()}); run `python -c 'import math_verify'` "
                                               "to see the error") from None
                    self._replace(slot)
                    continue
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "result" and w.items and msg[1] == w.items[0]:
                    self.graded += 1
                    finish(w, msg[2], time.monotonic())
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if not w.busy or now < w.deadline:
                    continue
                cpu = _cpu_seconds(w.proc.pid) if w.cpu0 is not None else None
                used = None if cpu is None else cpu - w.cpu0
                nxt = next_check(w.started, now, self.timeout_s, self.starved_grace, used)
                if nxt is None:
                    self.timeouts += 1
                    drop(slot, "grader_timeout", now)
                else:
                    w.deadline = nxt
        return results  # type: ignore[return-value]
