"""OS primitives of the sandbox runtime, used inside the template process (standard library only):
namespaces, capabilities, the seccomp program, and `setup_isolation`, which finds out what this host
permits and sets the template up accordingly. Loaded by template.py from this directory (not as part
of rstar2_core)."""

from __future__ import annotations

import array
import ctypes
import errno
import os
import signal
import socket
import sys

import sbx_rootfs

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC, CLONE_PARENT = 0x8000000, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 22, 38
SECCOMP_MODE_FILTER = 2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
CAP_V3 = 0x20080522
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220  # aarch64: 220
MAX_HANDOVER = 64   # namespace fds per message to the reaper
REAPER_THREADS = 4
# Bits of the start-up probe child's exit status: what a call's own set-up could do on this host.
PROBE_TMP, PROBE_PROC, PROBE_NETNS, PROBE_SECCOMP = 1, 2, 4, 8

libc = ctypes.CDLL(None, use_errno=True)
plibc = ctypes.PyDLL(None, use_errno=True)   # keeps the GIL across clone(), like os.fork()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def unshare(flags: int) -> None:
    _check(libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(libc.setns(fd, nstype), "setns")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_NO_CAPS = (CapData * 2)(CapData(0, 0, 0), CapData(0, 0, 0))
_CAP_HEADER = CapHeader(CAP_V3, 0)


def drop_caps() -> None:
    """Effective, permitted and inheritable capabilities all empty (ambient follows inheritable)."""
    _check(libc.capset(ctypes.byref(_CAP_HEADER), _NO_CAPS), "capset")


def drop_bounding_set() -> None:
    """Empty the capability bounding set, so no exec can ever grant a capability. The template calls
    this once (it keeps its own effective capabilities and never execs); its children inherit it."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if cap == 0:
        e = ctypes.get_errno()
        raise OSError(e, f"PR_CAPBSET_DROP: {os.strerror(e)}")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(bpf: bytes) -> SockFprog:
    """The `struct sock_fprog` for a compiled BPF program, built once in the template."""
    n = len(bpf) // ctypes.sizeof(SockFilter)
    insns = (SockFilter * n).from_buffer_copy(bpf)
    prog = SockFprog(n, ctypes.cast(insns, ctypes.POINTER(SockFilter)))
    prog._insns = insns   # keep the instructions alive with the program
    return prog


def load_seccomp(prog: SockFprog) -> None:
    """Install the filter on this process (needs no_new_privs or CAP_SYS_ADMIN); inherited by every
    process it starts, at no cost per fork."""
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def clone_newpid(extra: int = 0) -> int:
    """fork() into a new PID namespace (the child is its PID 1), and the namespaces of `extra` (0 or
    CLONE_NEWIPC: the only other one the seccomp filter lets through, syscalls.py)."""
    return clone_child(CLONE_NEWPID | extra)


def call_clone_flags(f: dict, parent: bool = True) -> int:
    """The clone flags of a call's child on this host (`f`: the features): a new PID namespace and
    IPC namespace where the host allows them, and CLONE_PARENT when `parent` (the zygote's clones,
    so that the child is the template's; the template's start-up probe clones its own child)."""
    flags = CLONE_PARENT if parent else 0
    if f["pidns"]:
        flags |= CLONE_NEWPID | (CLONE_NEWIPC if f["ipcns"] else 0)
    return flags


def clone_child(flags: int) -> int:
    """fork() with the clone `flags` (namespaces, CLONE_PARENT). Python's fork hooks run around it."""
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = plibc.syscall(SYS_CLONE, flags | signal.SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, os.strerror(err))
    return pid


def mount(src: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None) -> None:
    _check(libc.mount(src, target, fstype, flags, data), f"mount {target!r}")


# The seccomp filter lets mount() through with exactly these flags (syscalls.CALL_MOUNT_FLAGS).
TMP_FLAGS, PROC_FLAGS = MS_NOSUID | MS_NODEV, MS_NOSUID | MS_NODEV | MS_NOEXEC


def mount_call_tmp(tmp_opts: bytes, links: list[str]) -> None:
    """A fresh tmpfs on /tmp, with `links` (sbx_rootfs.tmp_links: the root's paths under /tmp) linked
    back to where the root holds them."""
    mount(b"tmp", b"/tmp", b"tmpfs", TMP_FLAGS, tmp_opts)
    for name in links:
        os.symlink(f"{sbx_rootfs.TMP_HOLD}/{name}", f"/tmp/{name}")


def mount_call_dirs(tmp_opts: bytes, proc: bool, links: list[str]) -> None:
    """In a call's own mount namespace (`enter_call_mount_ns`): a fresh tmpfs on /tmp (also /dev/shm,
    cwd, HOME) and, when the call has its own PID namespace, a procfs that shows only that namespace."""
    mount_call_tmp(tmp_opts, links)
    if proc:
        mount(b"proc", b"/proc", b"proc", PROC_FLAGS)


# ------------------------------------------------------------------------------------ host set-up
def mount_scratch(workdir: str, size_mb: int) -> None:
    """Unconfined templates: a size-limited tmpfs over `workdir` (in a private mount namespace) for the
    calls' directories (rmdir on this host's disk cost ~4 ms per call, on tmpfs ~5 us)."""
    unshare(CLONE_NEWNS)
    mount(None, b"/", None, MS_REC | MS_PRIVATE)
    mount(b"rstar2-scratch", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={int(size_mb)}m,mode=711".encode())


def confine_template(workdir: str, binds: list[str], masks: list[str], copies: list[str]) -> tuple[int, list[str]]:
    """A private mount namespace whose root is the minimal root built on `workdir` (sbx_rootfs.py).
    Returns the number of mounts in it and the entries each call links from its /tmp (`mount_call_tmp`)."""
    unshare(CLONE_NEWNS)
    mount(None, b"/", None, MS_REC | MS_PRIVATE)
    n = sbx_rootfs.build(workdir, binds, masks, copies)
    sbx_rootfs.pivot(workdir)
    return n, sbx_rootfs.tmp_links("")


def setup_isolation(s: dict, procfd: int) -> dict:
    """Enter a network namespace (and a user namespace when not root), build the minimal root or the
    scratch tmpfs, probe PID namespaces. `s`: the template's settings; `procfd`: the host's /proc."""
    network, workdir = s["network"], s["workdir"]
    f = {"root": os.geteuid() == 0, "userns": False, "netns": False, "pidns": False, "uid_drop": False,
         "scratch_tmpfs": False, "ipcns": False, "minimal_root": None, "root_mounts": 0, "tmp_links": [], "private_tmp": False,
         "own_proc": False, "netns_per_slot": False, "seccomp": False, "caps_dropped": False, "notes": []}
    uid, gid = os.getuid(), os.getgid()
    if not s.get("namespaces", True):
        f["notes"].append("namespaces disabled by configuration (sandbox.namespaces = false)")
        f["uid_drop"] = f["root"]
        _note_hidden_interpreter(f)
        return f
    netns_error = ""
    if network == "isolated":
        try:
            unshare(CLONE_NEWNET)
            f["netns"] = True
        except OSError as e:
            netns_error = f"unshare(CLONE_NEWNET): {e.strerror}"
    if not f["root"]:
        try:  # an unprivileged user namespace gives us the capabilities for the other namespaces
            unshare(CLONE_NEWUSER | (CLONE_NEWNET if network == "isolated" and not f["netns"] else 0))
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
    if network == "isolated" and not f["netns"]:
        f["notes"].append(netns_error)
    elif network != "isolated":
        f["notes"].append("network = host: calls share the host's network namespace")
    if s.get("confine") and s.get("root_plan"):
        try:
            plan = s["root_plan"]
            f["root_mounts"], f["tmp_links"] = confine_template(workdir, plan["binds"], plan["masks"],
                                                                plan.get("copies", []))
            f["minimal_root"] = "pivot_root"
        except OSError as e:
            f["notes"].append(f"minimal root: {e}; calls see the host's file system")
    if not f["minimal_root"] and s.get("scratch_mb"):
        try:
            mount_scratch(workdir, s["scratch_mb"])
            f["scratch_tmpfs"] = True
        except OSError as e:
            f["notes"].append(f"scratch tmpfs: {e.strerror or e}; call directories stay on the host's disk")
    try:
        pid = clone_newpid()
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, st = os.waitpid(pid, 0)
        f["pidns"] = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    except OSError as e:
        f["notes"].append(f"clone(CLONE_NEWPID): {e.strerror}")
    if f["pidns"]:   # each call's own IPC namespace, made by the same clone
        try:
            pid = clone_newpid(CLONE_NEWIPC)
            if pid == 0:
                os._exit(0)
            _, st = os.waitpid(pid, 0)
            f["ipcns"] = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
        except OSError as e:
            f["notes"].append(f"clone(CLONE_NEWPID | CLONE_NEWIPC): {e.strerror}")
    f["uid_drop"] = f["root"] and not f["userns"]
    _note_hidden_interpreter(f)
    return f


def _note_hidden_interpreter(f: dict) -> None:
    """Without a minimal root, calls under their own uid read the host's files as that uid: an
    interpreter installed where other users cannot enter (e.g. under /root) then loses every module
    the template did not preload. The capability that would hide this is not kept (it reads any file)."""
    if f["uid_drop"] and not f["minimal_root"]:
        hidden = sorted({p for p in sys.path if p and not world_readable_path(p)})
        if hidden:
            f["notes"].append(f"interpreter paths not readable by the calls' uids ({hidden[0]}...) and no minimal "
                              "root to expose them: calls can import only the modules the template preloaded")


def world_readable_path(path: str) -> bool:
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


class CallSetup:
    """What each call's set-up needs: `conf` for sbx_child.run_child, the template's own network and
    mount namespaces (fds), the slots' network namespaces (the namespaces go to the zygote, which
    sets each call up: sbx_zygote.py), the reaper's socket (the template's)."""

    def __init__(self):
        self.conf: dict = {"tmp_opts": None, "proc": False, "tmp_links": []}
        self.home_net, self.home_mnt = -1, -1
        self.slot_net: dict[int, int] = {}
        self.reaper: socket.socket | None = None

    def ns_fds(self) -> set[int]:
        """The namespace fds held here (those the zygote keeps)."""
        return {fd for fd in (self.home_mnt, self.home_net, *self.slot_net.values()) if fd >= 0}


def prepare_calls(f: dict, s: dict, procfd: int) -> CallSetup:
    """Decide, by probing, what each call's own set-up does (the zygote's, sbx_zygote.py, and the
    child's, sbx_child.py), and record it in `f` (the features the template reports)."""
    cs = CallSetup()
    confined = f["minimal_root"] is not None
    bpf = s.get("seccomp_bpf") if s.get("confine") else None
    prog = seccomp_program(bytes.fromhex(bpf)) if bpf else None
    tmp_mb = max(1, int(s.get("scratch_mb", 0)) // max(1, int(s["slots"])))
    tmp_opts = f"size={tmp_mb}m,nr_inodes=16384,mode=700".encode()
    if confined and f["netns"]:
        cs.home_net = os.open("thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC, dir_fd=procfd)
        cs.slot_net[0] = new_netns(procfd, cs.home_net)
    if confined:
        cs.home_mnt = os.open("thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=procfd)
        cs.reaper = start_reaper()
    try:
        drop_bounding_set()
        f["caps_dropped"] = True
    except OSError as e:   # without CAP_SETPCAP (not root, no user namespace) the set grants nothing
        f["caps_dropped"] = not f["root"] and not f["userns"]
        f["notes"].append(f"capability bounding set kept: {e}")
    if prog is not None:   # on the template itself: every call inherits it (syscalls.py)
        try:
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            load_seccomp(prog)
        except OSError as e:
            f["notes"].append(f"the seccomp filter could not be installed: {e}")
            prog = None
    bits = probe_call_setup(f, tmp_opts if confined else None, cs.slot_net.get(0, -1), prog is not None, procfd,
                            cs.home_mnt)
    f["private_tmp"] = bool(bits & PROBE_TMP)
    f["own_proc"] = bool(bits & PROBE_PROC)
    f["netns_per_slot"] = bool(bits & PROBE_NETNS)
    f["seccomp"] = bool(bits & PROBE_SECCOMP)
    if confined and not f["private_tmp"]:
        raise RuntimeError("the minimal root is up but a call cannot mount its own /tmp")
    if f["private_tmp"]:
        f["tmp_mb"] = tmp_mb
        if f["pidns"] and not f["own_proc"]:   # e.g. a user namespace: no procfs where none is visible
            f["notes"].append("a call cannot mount its own /proc here: /proc is empty in calls")
    if prog is not None and not f["seccomp"]:
        f["notes"].append("the seccomp filter is installed but a call's refused system call went through")
    cs.conf = {"tmp_opts": tmp_opts if f["private_tmp"] else None, "proc": f["own_proc"], "tmp_links": f["tmp_links"]}
    return cs


def probe_call_setup(f: dict, tmp_opts: bytes | None, netns_fd: int, filtered: bool, procfd: int,
                     home_mnt: int) -> int:
    """Run one child, cloned by the template itself before the zygote exists, through a call's set-up
    (the zygote and sbx_child.py do the same per call): the call's clone flags, its own mount
    namespace with /tmp (when `tmp_opts`) and /proc, its slot's network namespace; and, when the
    template is `filtered`, whether a refused system call is refused in the child. Returns which
    steps worked (PROBE_* bits)."""
    nsfd = -1
    try:
        if tmp_opts:
            nsfd = enter_call_mount_ns(procfd)
        pid = clone_child(call_clone_flags(f, parent=False))
    except OSError:
        pid = -1
    if pid == 0:
        ok = 0
        try:
            if tmp_opts:
                mount_call_tmp(tmp_opts, f["tmp_links"])
                if all(os.path.exists(f"/tmp/{name}") for name in f["tmp_links"]):
                    ok |= PROBE_TMP
                if f["pidns"]:
                    mount(b"proc", b"/proc", b"proc", PROC_FLAGS)
                    ok |= PROBE_PROC
        except OSError:
            pass
        if netns_fd >= 0:
            try:
                setns(netns_fd, CLONE_NEWNET)
                ok |= PROBE_NETNS
            except OSError:
                pass
        if filtered and libc.ptrace(0, 0, 0, 0) == -1 and ctypes.get_errno() == errno.EPERM:  # PTRACE_TRACEME
            ok |= PROBE_SECCOMP
        os._exit(ok)
    if nsfd >= 0:
        setns(home_mnt, CLONE_NEWNS)
        os.close(nsfd)
    if pid < 0:
        return 0
    _, st = os.waitpid(pid, 0)
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else 0


def enter_call_mount_ns(procfd: int) -> int:
    """Move this process (the zygote; the template for its probe) into a fresh copy of its mount
    namespace, for the child it clones next, and return an fd to it. It goes back to its own with
    setns(home) right after the clone; the fd keeps the namespace alive after the call, so its
    teardown (an RCU grace period: ~0.2-6 ms on this loaded VM) happens in the reaper, not in the
    call's exit path (`start_reaper`)."""
    unshare(CLONE_NEWNS)
    return os.open("thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=procfd)


def make_mount_ns(procfd: int, home_mnt: int) -> int:
    """A fresh copy of this process's mount namespace (the zygote's, which is the template's), made
    ahead of the call that will use it (while the zygote is idle); the caller stays in its own."""
    fd = enter_call_mount_ns(procfd)
    setns(home_mnt, CLONE_NEWNS)
    return fd


def start_reaper() -> socket.socket:
    """A helper process that closes the namespace fds it is sent (SCM_RIGHTS over a stream socket: a
    datagram socketpair queues only 10 messages); returns the template's non-blocking end. Its
    closer threads wait out grace periods side by side (concurrent waiters share one). It never
    forks, so threads are safe there; it dies with the template."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)   # EOF when the template goes
    template = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != template:   # it died before the line above
                os._exit(0)
            os.closerange(0, theirs.fileno())
            os.closerange(theirs.fileno() + 1, 1 << 20)
            _reap(theirs)
        finally:
            os._exit(0)
    theirs.close()
    ours.setblocking(False)
    return ours


def _reap(sock: socket.socket) -> None:
    import queue
    import threading

    todo: queue.SimpleQueue = queue.SimpleQueue()

    def closer() -> None:
        while True:
            os.close(todo.get())

    for _ in range(REAPER_THREADS):
        threading.Thread(target=closer, daemon=True).start()
    while True:
        msg, anc, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * MAX_HANDOVER))
        if not msg:
            return
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                for fd in array.array("i", data[: len(data) - len(data) % 4]):
                    todo.put(fd)


def hand_over(reaper: socket.socket | None, fds: list[int]) -> bool:
    """Give the reaper `fds` to close (one message) and close ours; False (nothing closed) when it
    cannot take them now."""
    if reaper is not None:
        try:
            reaper.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BlockingIOError:
            return False
        except OSError:
            pass   # the reaper is gone: the closes (and the teardowns) are ours
    for fd in fds:
        os.close(fd)
    return True


def new_netns(procfd: int, home_fd: int) -> int:
    """A fresh network namespace (no interfaces up) for one call slot: returns an fd to it; the
    caller (the template for slot 0, the zygote for the others) goes back to its own (`home_fd`)."""
    unshare(CLONE_NEWNET)
    try:
        return os.open("thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC, dir_fd=procfd)
    finally:
        setns(home_fd, CLONE_NEWNET)


def vm_size_bytes(procfd: int) -> int:
    fd = os.open("self/status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=procfd)
    try:
        text = os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)
    for line in text.splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0
