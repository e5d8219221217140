"""The warm template process: imports the configured modules once, then has one isolated child per
tool call cloned by its zygote and supervises it (limits, output caps, timeout, clean-up).

Run only by `rstar2_core.sandbox.service` as `python -I template.py '<json settings>'` (isolated mode:
no PYTHON* variables, no script directory on sys.path, so this package's `types.py` cannot shadow the
standard library inside the user's program). Standard library only; never import `rstar2_core` here,
so the user's program does not find the trainer's modules already loaded. Its helpers live in
`confined/` (`sbx_isolation.py`: namespaces, capabilities, seccomp, host probing; `sbx_rootfs.py`:
the minimal root; `sbx_zygote.py`: the process that clones the children; `sbx_child.py`: the child
side of a call) and are imported from there by file location.

At start (confined/sbx_isolation.py, sbx_rootfs.py): a network namespace, a mount namespace whose root
is the minimal read-only root of the service's plan (pivot_root), a reaper process that tears down
the calls' mount namespaces, an empty capability bounding set, the seccomp filter (on the template
itself: calls inherit it), one probe child that finds out which per-call steps this host allows;
then the preloads, imported inside that root; then the zygote, forked before any request.

The template holds the requests' code and stdin and the calls' output, so once it has read a request
it forks nothing that runs a program (only, without PID namespaces, `_kill_uid`'s helper): every
call's child is cloned by the zygote (confined/sbx_zygote.py), which holds none of them, with
CLONE_PARENT so that it is this template's child all the same (wait4, rusage, kill). The template
sends the zygote the call's slot, uid and limits with the call's pipe fds, and writes the code into
a pipe the child reads after the clone. A call's child thus cannot find another call's code or
output, running or finished, in its frames, objects or memory. A template whose zygote dies stops
(RuntimeError, idle or not); the service restarts it.

Per call (see docs/sandbox.md for what is and is not isolated):
- a fresh child from the zygote's `clone(CLONE_PARENT | CLONE_NEWPID | CLONE_NEWIPC)`: the program
  is PID 1 of its own PID namespace, so when it exits or is killed the kernel kills every process it
  started, double-forked daemons included;
  without PID namespaces (host forbids them) it gets its own session and the group is killed;
- its own mount namespace (made by the zygote ahead of the call, handed to the reaper after)
  with a fresh tmpfs on /tmp (cwd, HOME, /dev/shm) and a procfs of its PID namespace; where there is
  none, a fresh private working directory removed afterwards;
- its own uid from this template's pool when the service runs as root (so RLIMIT_NPROC is per call,
  and it cannot signal or write anything of the service's), rlimits AS/CPU/NPROC/FSIZE/CORE/NOFILE,
  no capabilities, no_new_privs, the inherited seccomp filter, a scrubbed environment, and
  PR_SET_PDEATHSIG so it dies with the template;
- its own IPC namespace (the same clone): System V shared memory, message queues, semaphores and
  POSIX message queues are the call's own and go with it;
- its slot's network namespace (made by the zygote on the slot's first call, no interfaces up; an
  unprivileged uid cannot bring loopback up): no network, and no abstract Unix socket shared with a
  concurrent call;
- stdout/stderr read incrementally: the first bytes are kept, the rest counted and thrown away;
  a flood beyond `drain_bytes` gets the tree killed (status output_limit).

Protocol (both ways: confined/sbx_frames.py, a 4-byte big-endian length + a pickle): the service sends request dicts
{cid, code, stdin, timeout_s, cpu_s, memory_mb, nproc, fsize_mb, max_chars, mode, drain_bytes}, or None
to stop; the template first sends a hello dict, then one result dict per request:
{cid, status, stdout, stderr, exit_code, duration_s, truncated}.
"""


from __future__ import annotations

import collections
import errno
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import sys
import time

_CONFINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confined")
sys.path.insert(0, _CONFINED)   # only while importing our helpers (names no program would use)
import sbx_child as child
import sbx_frames as frames
import sbx_isolation as iso
import sbx_zygote as zygote

sys.path.remove(_CONFINED)

READ_CHUNK = 65536
MAX_DEAD_NS = 1024   # finished calls' mount namespaces (their /tmp in RAM) waiting for the reaper

# ------------------------------------------------------------------------------- the parent side
class _Call:
    __slots__ = (
        "code",
        "code_fd",
        "cwd",
        "deadline",
        "err",
        "exited",
        "kill_reason",
        "nsfd",
        "open_fds",
        "out",
        "pid",
        "pidfd",
        "req",
        "rusage",
        "slot",
        "stdin",
        "stdin_fd",
        "t0",
        "wait_status",
    )

    def __init__(self, req: dict, slot: int, cwd: str):
        self.req, self.slot, self.cwd = req, slot, cwd
        self.out, self.err = _Capture(req), _Capture(req)
        self.stdin = memoryview(req["stdin"].encode("utf-8", "surrogatepass"))  # lone surrogates: U+FFFD
        code = req["code"].encode("utf-8", "surrogatepass")   # the child decodes it the same way
        self.code = memoryview(len(code).to_bytes(8, "big") + code)
        self.code_fd = -1
        self.pid: int | None = None   # known when the zygote answers
        self.pidfd = -1
        self.kill_reason: str | None = None
        self.nsfd = -1   # the call's own mount namespace, when it has one
        self.exited = False
        self.open_fds: set[int] = set()


class _Capture:
    """Keeps the first bytes of a stream (enough for max_chars characters), counts the rest."""

    __slots__ = ("chunks", "keep", "kept", "total")

    def __init__(self, req: dict):
        self.keep = 4 * int(req["max_chars"]) + 4
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if self.kept < self.keep:
            piece = data[: self.keep - self.kept]
            self.chunks.append(piece)
            self.kept += len(piece)

    def text(self, max_chars: int) -> tuple[str, bool]:
        s = b"".join(self.chunks).decode("utf-8", errors="replace")
        cut = len(s) > max_chars or self.total > self.kept
        return s[:max_chars], cut


class Template:
    def __init__(self, settings: dict):
        self.s = settings
        self.sel = selectors.EpollSelector()
        self.ctrl_in, self.ctrl_out = settings["ctrl_in"], settings["ctrl_out"]
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.calls: dict[int, _Call] = {}      # pid -> call
        self.fd_owner: dict[int, tuple[_Call, str]] = {}
        self.free_slots = list(range(int(settings["slots"])))[::-1]
        self.cloning: collections.deque[_Call] = collections.deque()  # sent to the zygote, no pid yet
        self.pending: collections.deque[dict] = collections.deque()  # waiting for a free slot
        self.stopping = False
        self.seq = 0
        self.dead_ns: list[int] = []   # mount namespaces of finished calls, for the reaper

    # -- start
    def start(self) -> None:
        iso.libc.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.s["parent_pid"]:
            os._exit(1)
        # The host's /proc, kept open for the template's own needs: the minimal root has none.
        self.procfd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        feats = iso.setup_isolation(self.s, self.procfd)
        self.cs = iso.prepare_calls(feats, self.s, self.procfd)
        for name in ("ast", "io", "linecache", "traceback", "types"):  # what _run_program needs
            importlib.import_module(name)
        loaded, missing = [], []
        for name in self.s["preload"]:   # inside the minimal root: a file missing there shows up here
            try:
                importlib.import_module(name)
                loaded.append(name)
            except Exception as e:  # noqa: BLE001 - a missing optional module is reported, not fatal
                missing.append(f"{name}: {type(e).__name__}: {e}")
        child.init_stdio()
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        gc.collect()
        gc.freeze()  # keep the collector from touching (and so copying) the template's pages in children
        self.feats, self.as_base = feats, iso.vm_size_bytes(self.procfd)
        self.uids = None
        if feats["uid_drop"]:
            self.uids = [int(self.s["uid_base"]) + i for i in range(int(self.s["slots"]))]
        # Before any request: the zygote's memory holds none, and every call's child is cloned from it.
        self.zygote = zygote.start(feats, self.cs, self.procfd, self.as_base)
        for fd in (self.ctrl_in, self.ctrl_out):
            os.set_blocking(fd, False)
        self.sel.register(self.ctrl_in, selectors.EVENT_READ, "ctrl")
        # The zygote's answers (a call's pid), and its EOF when it dies: an idle template then stops too.
        self.sel.register(self.zygote.sock, selectors.EVENT_READ, "zygote")
        self._send({"hello": True, "kind": self.s["kind"], "pid": os.getpid(), "features": feats,
                    "preloaded": loaded, "missing": missing, "vm_mb": self.as_base >> 20,
                    "zygote_pid": self.zygote.pid})

    # -- messages
    def _send(self, msg: dict) -> None:
        had = bool(self.outbuf)
        self.outbuf += frames.frame(msg)
        if not had:
            self._flush_out()

    def _flush_out(self) -> None:
        while self.outbuf:
            try:
                n = os.write(self.ctrl_out, self.outbuf)
            except BlockingIOError:
                break
            del self.outbuf[:n]
        key = self.sel.get_map().get(self.ctrl_out)
        if self.outbuf and key is None:
            self.sel.register(self.ctrl_out, selectors.EVENT_WRITE, "ctrl_out")
        elif not self.outbuf and key is not None:
            self.sel.unregister(self.ctrl_out)

    def _read_ctrl(self) -> None:
        while True:
            try:
                data = os.read(self.ctrl_in, 1 << 20)
            except BlockingIOError:
                break
            if not data:  # the service went away: stop
                self.stopping = True
                self.sel.unregister(self.ctrl_in)
                return
            self.inbuf += data
        for msg in frames.unframe(self.inbuf):
            if msg is None:
                self.stopping = True
            else:
                self.pending.append(msg)

    # -- calls
    def _spawn(self, req: dict) -> None:
        """Send the zygote a call's spec with its pipes and go on: the pid comes back as an event
        (`_on_zygote`). Output and code pipes work before the clone (the child finds its code waiting)."""
        slot = self.free_slots.pop()
        self.seq += 1
        cwd = ("/tmp" if self.cs.conf["tmp_opts"]
               else os.path.join(self.s["workdir"], f"{self.s['kind']}{os.getpid()}-{self.seq}"))
        call = _Call(req, slot, cwd)
        made: list[int] = []
        try:
            in_r, in_w = os.pipe() if call.stdin else (self.devnull, -1)
            made += [in_r, in_w] if call.stdin else []
            out_r, out_w = os.pipe()
            made += [out_r, out_w]
            err_r, err_w = os.pipe()
            made += [err_r, err_w]
            code_r, code_w = os.pipe()
            made += [code_r, code_w]
            call.t0 = time.monotonic()
            call.deadline = call.t0 + float(req["timeout_s"])
            spec = {"slot": slot, "uid": self.uids[slot] if self.uids else None, "cwd": cwd,
                    **{k: req[k] for k in ("memory_mb", "cpu_s", "nproc", "fsize_mb")}}   # no code, no stdin
            self.zygote.send(spec, [in_r, out_w, err_w, code_r])
        except OSError:
            for fd in made:
                os.close(fd)
            self.free_slots.append(slot)
            raise
        for fd in (in_r, out_w, err_w, code_r):   # the zygote's message holds its own copies
            if fd != self.devnull:
                os.close(fd)
        self.cloning.append(call)
        for fd, role in ((out_r, "out"), (err_r, "err")):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, role)
            self.fd_owner[fd] = (call, role)
            call.open_fds.add(fd)
        call.stdin_fd, call.code_fd = in_w, code_w
        for fd, role in ((code_w, "code"), (in_w, "in")):
            if fd >= 0:
                os.set_blocking(fd, False)
                self.fd_owner[fd] = (call, role)
                call.open_fds.add(fd)
                self._write_input(call, role)

    def _on_zygote(self) -> None:
        """Take the zygote's answers (in the order of the sends): a running call gets its pid, pidfd and
        exit watch; a call it could not clone fails with `internal`, the template goes on."""
        while (reply := self.zygote.reply()) is not None:
            if not self.cloning or reply["slot"] != self.cloning[0].slot:
                raise RuntimeError(f"{zygote.DIED}: answer for slot {reply['slot']} out of order")
            call = self.cloning.popleft()
            if "error" in reply:
                self._spawn_failed(call, OSError(reply["errno"], reply["error"]))
                continue
            call.pid, call.nsfd = reply["pid"], reply["nsfd"]
            try:
                call.pidfd = os.pidfd_open(call.pid)
            except OSError as e:   # e.g. out of fds: the child must not outlive the call
                os.kill(call.pid, signal.SIGKILL)
                os.waitpid(call.pid, 0)
                self._spawn_failed(call, e)
                continue
            self.calls[call.pid] = call
            os.set_blocking(call.pidfd, False)
            self.sel.register(call.pidfd, selectors.EVENT_READ, "exit")
            self.fd_owner[call.pidfd] = (call, "exit")
            call.open_fds.add(call.pidfd)
            if call.kill_reason is not None:   # asked for before the pid was known (output flood, stop)
                self._kill(call, call.kill_reason)

    def _spawn_failed(self, call: _Call, err: OSError) -> None:
        """A call whose child never ran (or was killed before it could): close its pipes, hand its
        namespace to the reaper, free its slot, answer `internal`."""
        for fd in list(call.open_fds):
            self._close_fd(call, fd)
        if call.nsfd >= 0:
            self.dead_ns.append(call.nsfd)
            call.nsfd = -1
        self.free_slots.append(call.slot)
        self._send_spawn_error(call.req, err)

    def _send_spawn_error(self, req: dict, err: OSError) -> None:
        self._send({"cid": req["cid"], "status": "internal", "stdout": "", "exit_code": None,
                    "stderr": f"sandbox could not start the program: {err}", "duration_s": 0.0, "truncated": False})

    def _write_input(self, call: _Call, role: str) -> None:
        """Feed the child its code ("code") or stdin ("in") as far as the pipe takes it; the rest when
        the pipe has room again. The pipe is closed at the end (EOF for the child)."""
        fd, data = (call.code_fd, call.code) if role == "code" else (call.stdin_fd, call.stdin)
        try:
            while data:
                n = os.write(fd, data[:READ_CHUNK])
                data = data[n:]
        except BlockingIOError:
            if fd not in self.sel.get_map():
                self.sel.register(fd, selectors.EVENT_WRITE, role)
            return
        except BrokenPipeError:  # the program stopped reading (or died): its business
            data = memoryview(b"")
        finally:
            if role == "code":
                call.code = data
            else:
                call.stdin = data
        self._close_fd(call, fd)

    def _close_fd(self, call: _Call, fd: int) -> None:
        if fd in call.open_fds:
            if fd in self.sel.get_map():
                self.sel.unregister(fd)
            os.close(fd)
            call.open_fds.discard(fd)
            self.fd_owner.pop(fd, None)

    def _read_stream(self, call: _Call, fd: int, role: str) -> None:
        cap = call.out if role == "out" else call.err
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._close_fd(call, fd)
                return
            cap.add(data)
            over = cap.total > int(call.req["drain_bytes"]) or (call.req["mode"] == "reject" and cap.total > cap.keep)
            if over and call.kill_reason is None and not call.exited:
                self._kill(call, "output")

    def _kill(self, call: _Call, reason: str) -> None:
        call.kill_reason = reason
        if call.pid is None:   # still being cloned: killed when the zygote answers (`_on_zygote`)
            return
        try:
            if self.feats["pidns"]:
                os.kill(call.pid, signal.SIGKILL)   # PID 1 of its namespace: the kernel kills the rest
            else:
                os.killpg(call.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self.feats["pidns"]:
            self._kill_uid(call)

    def _kill_uid(self, call: _Call) -> None:
        """Without PID namespaces: kill every process of the call's own uid (daemons that left its
        process group included), from a short-lived helper running as that uid. The helper is a fork of
        this template (other calls' code and output in its memory): it makes itself non-dumpable
        before it takes the uid, so that no process of that uid can ptrace it or read its memory."""
        if not self.uids:
            return
        uid = self.uids[call.slot]
        pid = os.fork()
        if pid == 0:
            try:
                iso.libc.prctl(iso.PR_SET_DUMPABLE, 0, 0, 0, 0)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)   # every process this uid may signal, except the caller
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    def _on_exit(self, call: _Call) -> None:
        _, status, ru = os.wait4(call.pid, 0)
        call.exited, call.wait_status, call.rusage = True, status, ru
        if not self.feats["pidns"]:
            try:
                os.killpg(call.pid, signal.SIGKILL)  # leftovers of the program's process group
            except (ProcessLookupError, PermissionError):
                pass
            self._kill_uid(call)
        self._close_fd(call, call.pidfd)
        self._close_fd(call, call.stdin_fd)
        self._close_fd(call, call.code_fd)
        for fd, role in [(fd, self.fd_owner[fd][1]) for fd in list(call.open_fds)]:
            if role in ("out", "err"):
                self._read_stream(call, fd, role)
        # All writers are dead (the namespace is gone): a pipe still open here holds no more data.
        for fd in list(call.open_fds):
            self._close_fd(call, fd)
        self._finish(call)

    def _finish(self, call: _Call) -> None:
        req = call.req
        max_chars = int(req["max_chars"])
        stdout, cut_o = call.out.text(max_chars)
        stderr, cut_e = call.err.text(max_chars)
        truncated = cut_o or cut_e
        st = call.wait_status
        exit_code: int | None
        if os.WIFSIGNALED(st):
            exit_code = -os.WTERMSIG(st)
        else:
            exit_code = os.WEXITSTATUS(st)
        cpu = call.rusage.ru_utime + call.rusage.ru_stime
        if call.kill_reason == "timeout":
            status, exit_code = "timeout", None
        elif call.kill_reason == "output":
            status = "output_limit"
        elif exit_code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu >= max(1, int(req["cpu_s"] + 0.999)) - 0.05:
            status = "timeout"
        elif exit_code is not None and exit_code < 0:
            status = "killed"
        elif exit_code == child.EXIT_MEMORY:
            status, exit_code = "memory", 1
        elif exit_code == child.EXIT_SETUP:
            status = "internal"
        elif truncated and req["mode"] == "reject":
            status = "output_limit"
        elif exit_code == 0:
            status = "ok"
        else:
            status = "error"
        del self.calls[call.pid]
        self.free_slots.append(call.slot)
        if call.nsfd >= 0:   # its /tmp and /proc go with the namespace, torn down by the reaper
            self.dead_ns.append(call.nsfd)
            call.nsfd = -1
        if not self.cs.conf["tmp_opts"]:   # a private /tmp went away with the call's mount namespace
            try:
                os.rmdir(call.cwd)   # the common case: the program left its directory empty
            except OSError:
                shutil.rmtree(call.cwd, ignore_errors=True)
        self._send({"cid": req["cid"], "status": status, "stdout": stdout, "stderr": stderr,
                    "exit_code": exit_code, "duration_s": time.monotonic() - call.t0, "truncated": truncated,
                    "cpu_s": cpu})

    # -- loop
    def loop(self) -> None:
        while not (self.stopping and not self.calls and not self.cloning and not self.pending and not self.outbuf):
            if self.stopping and (self.calls or self.cloning):
                for call in [*self.calls.values(), *self.cloning]:
                    if call.kill_reason is None:
                        self._kill(call, "timeout")
            if self.stopping:
                self.pending.clear()
            while self.pending and self.free_slots:
                req = self.pending.popleft()
                try:
                    self._spawn(req)
                except OSError as e:  # e.g. out of fds: this call fails, not the template
                    self._send_spawn_error(req, e)
            now = time.monotonic()
            timeout = None
            for call in self.calls.values():
                if call.kill_reason is None and not call.exited:
                    if call.deadline <= now:
                        self._kill(call, "timeout")
                    else:
                        left = call.deadline - now
                        timeout = left if timeout is None else min(timeout, left)
            while self.dead_ns:   # one message per loop turn: fewer wake-ups of the reaper
                if iso.hand_over(self.cs.reaper, self.dead_ns[:iso.MAX_HANDOVER]):
                    del self.dead_ns[:iso.MAX_HANDOVER]
                elif len(self.dead_ns) > MAX_DEAD_NS:   # the reaper is far behind: tear down here
                    os.close(self.dead_ns.pop(0))
                else:
                    break   # retried on the next loop turn
            try:
                events = self.sel.select(timeout)
            except InterruptedError:
                continue
            for key, _ in events:
                role = key.data
                if role == "ctrl":
                    self._read_ctrl()
                elif role == "zygote":
                    self._on_zygote()   # RuntimeError when it died: the service restarts this template
                elif role == "ctrl_out":
                    try:
                        self._flush_out()
                    except BrokenPipeError:
                        self.stopping, self.outbuf = True, bytearray()
                        self.sel.unregister(self.ctrl_out)
                else:
                    owner = self.fd_owner.get(key.fd)
                    if owner is None:
                        continue
                    call, _ = owner
                    if role == "exit":
                        self._on_exit(call)
                    elif role in ("in", "code"):
                        self._write_input(call, role)
                    else:
                        self._read_stream(call, key.fd, role)


def main() -> None:
    settings = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # PDEATHSIG cleans up the children
    tpl = Template(settings)
    tpl.start()
    try:
        tpl.loop()
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise


if __name__ == "__main__":
    main()
