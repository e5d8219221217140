"""OS primitives of the sandbox runtime, used inside the template process (standard library only):
unshare/clone into namespaces, capabilities, the scratch tmpfs, and `setup_isolation`, which finds out
what this host permits. Loaded by template.py from this directory (not as part of rstar2_core)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 1, 8, 38
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
CAP_DAC_READ_SEARCH = 2
CAP_V3 = 0x20080522
SYS_CLONE = 56 if os.uname().machine == "x86_64" else 220  # aarch64: 220

libc = ctypes.CDLL(None, use_errno=True)
plibc = ctypes.PyDLL(None, use_errno=True)   # keeps the GIL across clone(), like os.fork()


def unshare(flags: int) -> None:
    if libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_caps(mask: int) -> None:
    """Set effective = permitted = `mask` (capabilities 0-31), inheritable none."""
    data = (CapData * 2)(CapData(mask, mask, 0), CapData(0, 0, 0))
    if libc.capset(ctypes.byref(CapHeader(CAP_V3, 0)), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


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


def clone_newpid() -> int:
    """fork() into a new PID namespace (the child is its PID 1). Python's fork hooks run around it."""
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = plibc.syscall(SYS_CLONE, CLONE_NEWPID | signal.SIGCHLD, 0, 0, 0, 0)
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
    unshare(CLONE_NEWNS)
    for args in ((None, b"/", None, MS_REC | MS_PRIVATE, None),
                 (b"rstar2-scratch", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={int(size_mb)}m,mode=711".encode())):
        if libc.mount(*args) != 0:
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
        f["keep_read_cap"] = f["uid_drop"] and any(p and not world_readable_path(p) for p in sys.path)
        return f
    if network == "isolated":
        try:
            unshare(CLONE_NEWNET)
            f["netns"] = True
        except OSError as e:
            f["notes"].append(f"unshare(CLONE_NEWNET): {e.strerror}")
    if not f["root"]:
        try:  # an unprivileged user namespace gives us the capabilities for netns and pidns
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
    if workdir and scratch_mb:
        try:
            mount_scratch(workdir, scratch_mb)
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
    f["uid_drop"] = f["root"] and not f["userns"]
    # An interpreter installed where other users cannot enter (e.g. under /root) would make every
    # import fail after the uid drop: then calls keep CAP_DAC_READ_SEARCH (read-only access) only.
    hidden = sorted({p for p in sys.path if p and not world_readable_path(p)})
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


