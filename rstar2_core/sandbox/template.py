"""The warm template process: imports the configured modules once, then forks one isolated child per
tool call and supervises it (limits, output caps, timeout, clean-up).

Run only by `rstar2_core.sandbox.service` as `python -I template.py '<json settings>'` (isolated mode:
no PYTHON* variables, no script directory on sys.path, so this package's `types.py` cannot shadow the
standard library inside the user's program). Standard library only; never import `rstar2_core` here,
so the user's program does not find the trainer's modules already loaded.

Per call (see docs/sandbox.md for what is and is not isolated):
- a fresh child from `clone(CLONE_NEWPID)`: the program is PID 1 of its own PID namespace, so when it
  exits or is killed the kernel kills every process it started, double-forked daemons included;
  without PID namespaces (host forbids them) it gets its own session and the group is killed;
- its own uid from this template's pool when the service runs as root (so RLIMIT_NPROC is per call,
  and it cannot signal or write anything of the service's), rlimits AS/CPU/NPROC/FSIZE/CORE/NOFILE,
  a fresh private working directory removed afterwards, a scrubbed environment, and PR_SET_PDEATHSIG
  so it dies with the template;
- the template's network namespace (made once at start, no interfaces up; an unprivileged uid cannot
  bring loopback up), so there is no network;
- stdout/stderr read incrementally: the first bytes are kept, the rest counted and thrown away;
  a flood beyond `drain_bytes` gets the tree killed (status output_limit).

Protocol (both ways: 4-byte big-endian length + pickle): the service sends request dicts
{cid, code, stdin, timeout_s, cpu_s, memory_mb, nproc, fsize_mb, max_chars, mode, drain_bytes}, or None
to stop; the template first sends a hello dict, then one result dict per request:
{cid, status, stdout, stderr, exit_code, duration_s, truncated}.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import gc
import importlib
import json
import os
import pickle
import resource
import selectors
import shutil
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
CAP_DAC_READ_SEARCH = 2
_CAP_V3 = 0x20080522
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220  # aarch64: 220
EXIT_MEMORY = 109   # the child runtime's code for "MemoryError" (reported as exit code 1)
EXIT_SETUP = 110    # the child could not set itself up: the service's fault (status internal)
READ_CHUNK = 65536
FILENAME = "<tool>"
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1"}

_libc = ctypes.CDLL(None, use_errno=True)
_plibc = ctypes.PyDLL(None, use_errno=True)   # keeps the GIL across clone(), like os.fork()


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _set_caps(mask: int) -> None:
    """Set effective = permitted = `mask` (capabilities 0-31), inheritable none."""
    data = (_CapData * 2)(_CapData(mask, mask, 0), _CapData(0, 0, 0))
    if _libc.capset(ctypes.byref(_CapHeader(_CAP_V3, 0)), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


def _world_readable_path(path: str) -> bool:
    """Whether every directory from / down to `path` lets other users in."""
    p = os.path.abspath(path)
    while True:
        try:
            if not os.stat(p).st_mode & 0o001:
                return False
        except OSError:
            return True  # a sys.path entry that does not exist hides nothing
        parent = os.path.dirname(p)
        if parent == p:
            return True
        p = parent


def _clone_newpid() -> int:
    """fork() into a new PID namespace (the child is its PID 1). Python's fork hooks run around it."""
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _plibc.syscall(SYS_CLONE, CLONE_NEWPID | signal.SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, os.strerror(err))
    return pid


# ------------------------------------------------------------------------------------ host set-up
def mount_scratch(workdir: str, size_mb: int) -> None:
    """A private mount namespace with a size-limited tmpfs over `workdir` for the calls' directories:
    rmdir on the host's disk cost ~4 ms per call here (ext4 mounted with `discard`), on tmpfs ~5 us,
    and the size limit bounds what all calls of this template can write there at once."""
    _unshare(CLONE_NEWNS)
    for args in ((None, b"/", None, MS_REC | MS_PRIVATE, None),
                 (b"rstar2-scratch", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={int(size_mb)}m,mode=711".encode())):
        if _libc.mount(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount {args[1]!r}: {os.strerror(e)}")


def setup_isolation(network: str, namespaces: bool = True, workdir: str = "", scratch_mb: int = 0) -> dict:
    """Enter a network namespace (and a user namespace when not root), mount the scratch tmpfs,
    probe PID namespaces."""
    f = {"root": os.geteuid() == 0, "userns": False, "netns": False, "pidns": False, "uid_drop": False,
         "scratch_tmpfs": False, "notes": []}
    uid, gid = os.getuid(), os.getgid()
    if not namespaces:
        f["notes"].append("namespaces disabled by configuration (sandbox.namespaces = false)")
        f["uid_drop"] = f["root"]
        f["keep_read_cap"] = f["uid_drop"] and any(p and not _world_readable_path(p) for p in sys.path)
        return f
    if network == "isolated":
        try:
            _unshare(CLONE_NEWNET)
            f["netns"] = True
        except OSError as e:
            f["notes"].append(f"unshare(CLONE_NEWNET): {e.strerror}")
    if not f["root"]:
        try:  # an unprivileged user namespace gives us the capabilities for netns and pidns
            _unshare(CLONE_NEWUSER | (CLONE_NEWNET if network == "isolated" and not f["netns"] else 0))
            with open("/proc/self/setgroups", "w") as fh:
                fh.write("deny")
            with open("/proc/self/uid_map", "w") as fh:
                fh.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as fh:
                fh.write(f"0 {gid} 1")
            f["userns"] = True
            f["netns"] = f["netns"] or network == "isolated"
        except OSError as e:
            f["notes"].append(f"unshare(CLONE_NEWUSER): {e.strerror}")
    if workdir and scratch_mb:
        try:
            mount_scratch(workdir, scratch_mb)
            f["scratch_tmpfs"] = True
        except OSError as e:
            f["notes"].append(f"scratch tmpfs: {e.strerror or e}; call directories stay on the host's disk")
    try:
        pid = _clone_newpid()
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, st = os.waitpid(pid, 0)
        f["pidns"] = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    except OSError as e:
        f["notes"].append(f"clone(CLONE_NEWPID): {e.strerror}")
    f["uid_drop"] = f["root"] and not f["userns"]
    # An interpreter installed where other users cannot enter (e.g. under /root) would make every
    # import fail after the uid drop: then calls keep CAP_DAC_READ_SEARCH (read-only access) only.
    hidden = sorted({p for p in sys.path if p and not _world_readable_path(p)})
    f["keep_read_cap"] = f["uid_drop"] and bool(hidden)
    if f["keep_read_cap"]:
        f["notes"].append(f"interpreter paths not readable by other users ({hidden[0]}...): calls keep "
                          "CAP_DAC_READ_SEARCH (may read any file, write none of the service's)")
    return f


def vm_size_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# -------------------------------------------------------------------------------- the child side
_CHILD_STDIO: tuple = ()


def make_child_stdio() -> tuple:
    """Text streams on fds 0-2 for the children, built once in the template (they hold no data until a
    child writes, and building them in every child cost ~0.7 ms of its ~3 ms)."""
    import io

    # Built while fds 0-2 are pipes, as in the children: the streams cache "not seekable".
    saved = [os.dup(fd) for fd in range(3)]
    r, w = os.pipe()
    for fd, src in ((0, r), (1, w), (2, w)):
        os.dup2(src, fd)
    try:
        streams = (io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
                                    errors="replace"),
                   io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                                    errors="backslashreplace"),
                   io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                    errors="backslashreplace", line_buffering=True))
        for st in streams:
            assert not st.seekable()
    finally:
        for fd in range(3):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
        os.close(r)
        os.close(w)
    return streams


def _child(req: dict, cwd: str, uid: int | None, fds: tuple[int, int, int], as_base: int,
           read_cap: bool) -> None:
    """Runs in the fresh child: isolate, then run the program. Never returns."""
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 20)
        os.mkdir(cwd, 0o700)
        if uid is not None:
            os.chown(cwd, uid, uid)
        os.chdir(cwd)
        mem = as_base + int(req["memory_mb"]) * (1 << 20)
        cpu = max(1, int(req["cpu_s"] + 0.999))
        for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, int(req["fsize_mb"]) << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, 256)):
            resource.setrlimit(lim, (val, val))
        if uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (req["nproc"], req["nproc"]))
            os.setgroups([])
            if read_cap:
                _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
            os.setgid(uid)
            os.setuid(uid)
            _set_caps(1 << CAP_DAC_READ_SEARCH if read_cap else 0)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.environ.clear()
        os.environ.update(CHILD_ENV, HOME=cwd, TMPDIR=cwd, PWD=cwd)
        sys.stdin, sys.stdout, sys.stderr = _CHILD_STDIO
        sys.argv = [""]
    except BaseException as e:  # noqa: BLE001 - any set-up failure is the service's fault
        os.write(2, f"sandbox set-up failed: {type(e).__name__}: {e}\n".encode())
        os._exit(EXIT_SETUP)
    os._exit(_run_program(req["code"]))


def _run_program(code: str) -> int:
    """Execute `code` as __main__; if its last statement is an expression, print its repr (notebook)."""
    import ast
    import builtins
    import linecache
    import traceback
    import types

    reserve = bytearray(64 << 10)  # freed on MemoryError so the traceback can still be printed
    rc = 0
    try:
        try:
            tree = ast.parse(code, FILENAME, "exec")
        except (SyntaxError, ValueError) as e:
            sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
            return _flush(1)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        exec(compile(tree, FILENAME, "exec"), main.__dict__)  # noqa: S102 - running it is the point
        if last is not None:
            value = eval(compile(last, FILENAME, "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code & 0xFF
        else:
            sys.stderr.write(f"{e.code}\n")
            rc = 1
    except MemoryError as e:
        del reserve
        try:
            _print_exception(e)
        finally:
            rc = EXIT_MEMORY
    except BaseException as e:  # noqa: BLE001 - the program's own exception, reported like python does
        _print_exception(e)
        rc = 1
    if "threading" in sys.modules:  # wait for non-daemon threads, as the interpreter would
        try:
            sys.modules["threading"]._shutdown()
        except BaseException:  # noqa: BLE001, S110 - the program's threads are its own business
            pass
    return _flush(rc)


def _print_exception(e: BaseException) -> None:
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))


def _flush(rc: int) -> int:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 - a closed or broken pipe: nothing left to tell
            pass
    return rc


# ------------------------------------------------------------------------------- the parent side
class _Call:
    __slots__ = (
        "cwd",
        "deadline",
        "err",
        "exited",
        "kill_reason",
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
        self.stdin = req["stdin"].encode("utf-8", "surrogatepass")  # lone surrogates reach the program as U+FFFD
        self.kill_reason: str | None = None
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
        self.pending: collections.deque[dict] = collections.deque()  # waiting for a free slot
        self.stopping = False
        self.seq = 0

    # -- start
    def start(self) -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.s["parent_pid"]:
            os._exit(1)
        feats = setup_isolation(self.s["network"], self.s.get("namespaces", True), self.s["workdir"],
                                self.s.get("scratch_mb", 0))
        for name in ("ast", "io", "linecache", "traceback", "types"):  # what _run_program needs
            importlib.import_module(name)
        loaded, missing = [], []
        for name in self.s["preload"]:
            try:
                importlib.import_module(name)
                loaded.append(name)
            except Exception as e:  # noqa: BLE001 - a missing optional module is reported, not fatal
                missing.append(f"{name}: {type(e).__name__}: {e}")
        global _CHILD_STDIO
        _CHILD_STDIO = make_child_stdio()
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        gc.collect()
        gc.freeze()  # keep the collector from touching (and so copying) the template's pages in children
        self.feats, self.as_base = feats, vm_size_bytes()
        self.uids = None
        if feats["uid_drop"]:
            self.uids = [int(self.s["uid_base"]) + i for i in range(int(self.s["slots"]))]
        for fd in (self.ctrl_in, self.ctrl_out):
            os.set_blocking(fd, False)
        self.sel.register(self.ctrl_in, selectors.EVENT_READ, "ctrl")
        self._send({"hello": True, "kind": self.s["kind"], "pid": os.getpid(), "features": feats,
                    "preloaded": loaded, "missing": missing, "vm_mb": self.as_base >> 20})

    # -- messages
    def _send(self, msg: dict) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        had = bool(self.outbuf)
        self.outbuf += struct.pack(">I", len(data)) + data
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
        while len(self.inbuf) >= 4:
            (n,) = struct.unpack(">I", self.inbuf[:4])
            if len(self.inbuf) < 4 + n:
                break
            msg = pickle.loads(bytes(self.inbuf[4:4 + n]))
            del self.inbuf[:4 + n]
            if msg is None:
                self.stopping = True
            else:
                self.pending.append(msg)

    # -- calls
    def _spawn(self, req: dict) -> None:
        slot = self.free_slots.pop()
        self.seq += 1
        call = _Call(req, slot, os.path.join(self.s["workdir"], f"{self.s['kind']}{os.getpid()}-{self.seq}"))
        made: list[int] = []
        try:
            in_r, in_w = os.pipe() if call.stdin else (self.devnull, -1)
            made += [in_r, in_w] if call.stdin else []
            out_r, out_w = os.pipe()
            made += [out_r, out_w]
            err_r, err_w = os.pipe()
            made += [err_r, err_w]
            call.t0 = time.monotonic()
            call.deadline = call.t0 + float(req["timeout_s"])
            uid = self.uids[slot] if self.uids else None
            pid = _clone_newpid() if self.feats["pidns"] else os.fork()
        except OSError:
            for fd in made:
                os.close(fd)
            self.free_slots.append(slot)
            raise
        if pid == 0:
            _child(req, call.cwd, uid, (in_r, out_w, err_w), self.as_base, self.feats["keep_read_cap"])
        for fd in (in_r, out_w, err_w):
            if fd != self.devnull:
                os.close(fd)
        call.pid = pid
        call.pidfd = os.pidfd_open(pid)
        self.calls[pid] = call
        for fd, role in ((out_r, "out"), (err_r, "err"), (call.pidfd, "exit")):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, role)
            self.fd_owner[fd] = (call, role)
            call.open_fds.add(fd)
        call.stdin_fd = in_w
        if in_w >= 0:
            os.set_blocking(in_w, False)
            self.fd_owner[in_w] = (call, "in")
            call.open_fds.add(in_w)
            self._write_stdin(call)

    def _write_stdin(self, call: _Call) -> None:
        fd = call.stdin_fd
        try:
            while call.stdin:
                n = os.write(fd, call.stdin[:READ_CHUNK])
                call.stdin = call.stdin[n:]
        except BlockingIOError:
            if fd not in self.sel.get_map():
                self.sel.register(fd, selectors.EVENT_WRITE, "in")
            return
        except BrokenPipeError:  # the program stopped reading: its business
            call.stdin = b""
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
        process group included), from a short-lived helper running as that uid."""
        if not self.uids:
            return
        uid = self.uids[call.slot]
        pid = os.fork()
        if pid == 0:
            try:
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
        elif exit_code == EXIT_MEMORY:
            status, exit_code = "memory", 1
        elif exit_code == EXIT_SETUP:
            status = "internal"
        elif truncated and req["mode"] == "reject":
            status = "output_limit"
        elif exit_code == 0:
            status = "ok"
        else:
            status = "error"
        del self.calls[call.pid]
        self.free_slots.append(call.slot)
        try:
            os.rmdir(call.cwd)   # the common case: the program left its directory empty
        except OSError:
            shutil.rmtree(call.cwd, ignore_errors=True)
        self._send({"cid": req["cid"], "status": status, "stdout": stdout, "stderr": stderr,
                    "exit_code": exit_code, "duration_s": time.monotonic() - call.t0, "truncated": truncated})

    # -- loop
    def loop(self) -> None:
        while not (self.stopping and not self.calls and not self.pending and not self.outbuf):
            if self.stopping and self.calls:
                for call in list(self.calls.values()):
                    if call.kill_reason is None:
                        self._kill(call, "timeout")
            if self.stopping:
                self.pending.clear()
            while self.pending and self.free_slots:
                req = self.pending.popleft()
                try:
                    self._spawn(req)
                except OSError as e:  # e.g. the host is out of processes: this call fails, not the template
                    self._send({"cid": req["cid"], "status": "internal", "stdout": "", "exit_code": None,
                                "stderr": f"sandbox could not start the program: {e}", "duration_s": 0.0,
                                "truncated": False})
            now = time.monotonic()
            timeout = None
            for call in self.calls.values():
                if call.kill_reason is None and not call.exited:
                    if call.deadline <= now:
                        self._kill(call, "timeout")
                    else:
                        left = call.deadline - now
                        timeout = left if timeout is None else min(timeout, left)
            try:
                events = self.sel.select(timeout)
            except InterruptedError:
                continue
            for key, _ in events:
                role = key.data
                if role == "ctrl":
                    self._read_ctrl()
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
                    elif role == "in":
                        self._write_stdin(call)
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
