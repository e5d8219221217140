"""Supervising one tool call inside the template process, from its request to its result: the call's
pipes and its spec sent to the zygote, its code and stdin fed to the child, stdout and stderr kept up
to `max_chars` and counted past it, the kills (timeout, output flood, stop), and the exit turned into
a status. `CallSupervisor` is a mixin of template.py's `Template`, which owns the selector, the zygote,
the slots and `_send`.

Invariant: the template forks nothing that runs a program once it holds a request; every call's child
comes from the zygote (sbx_zygote.py), and a call whose clone fails fails alone (`internal`).
Standard library only; loaded by template.py from this directory. See docs/sandbox.md, "The template
and its calls".
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import time

import sbx_child as child
import sbx_isolation as iso
import sbx_zygote as zygote

READ_CHUNK = 65536


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


class CallSupervisor:
    """The per-call half of `Template` (template.py): spawning, feeding, reading, killing, finishing."""

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
