"""The system-call filter of the sandbox: which calls are refused (EPERM; `clone3` ENOSYS, so that the
C library falls back to `clone`, whose flags the filter can see), compiled once per service to a
seccomp BPF program with libseccomp (through `pyseccomp`). Each template installs it on itself once
at start, before its preloads, and every call inherits it (no call loads its own: ~80 us each).

Invariant: a deny list in which the four system calls of a call's set-up (`CONDITIONAL`: mount,
unshare, setns, clone) pass only in the exact forms that set-up uses, each needing CAP_SYS_ADMIN,
which a call never has; system calls of another ABI kill the process. See docs/sandbox.md, "How it
works" (System-call filter), and the table in docs/sandbox-isolation.md.
"""

from __future__ import annotations

import errno
import functools
import tempfile
from dataclasses import dataclass

# name -> why no tool call needs it (docs/sandbox-isolation.md prints this table)
REFUSED: dict[str, str] = {
    **dict.fromkeys(("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp"),
                    "inspect or change another process"),
    **dict.fromkeys(("umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
                     "move_mount", "open_tree", "mount_setattr"), "change the file system view"),
    **dict.fromkeys(("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
                     "swapon", "swapoff", "acct", "syslog", "quotactl", "quotactl_fd", "lookup_dcookie",
                     "nfsservctl", "uselib", "_sysctl", "iopl", "ioperm", "vhangup", "sethostname",
                     "setdomainname", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex"),
                    "administer the kernel or the machine"),
    **dict.fromkeys(("bpf", "perf_event_open", "fanotify_init"), "load kernel programs or trace the system"),
    **dict.fromkeys(("keyctl", "add_key", "request_key"), "use the kernel keyrings (credentials)"),
    **dict.fromkeys(("open_by_handle_at", "name_to_handle_at"), "open files by handle, around path checks"),
    **dict.fromkeys(("memfd_create", "memfd_secret", "shmget", "msgget"),
                    "hold RAM outside the address-space limit (a file in memory, SysV shared memory or message queues)"),
    "userfaultfd": "stall the kernel on a page fault (exploit primitive)",
    **dict.fromkeys(("io_uring_setup", "io_uring_enter", "io_uring_register"),
                    "submit system calls the filter cannot see"),
}
NS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x2000000, "CLONE_NEWUTS": 0x4000000,
      "CLONE_NEWIPC": 0x8000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
_OTHER_NS = ("CLONE_NEWUSER", "CLONE_NEWPID", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWCGROUP", "CLONE_NEWTIME")
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
CALL_MOUNT_FLAGS = (MS_NOSUID | MS_NODEV, MS_NOSUID | MS_NODEV | MS_NOEXEC)   # a call's /tmp, its /proc
# name -> the forms refused (the rest pass the filter and need CAP_SYS_ADMIN; docs/sandbox.md)
CONDITIONAL: dict[str, str] = {
    "mount": "every mount but those with the flags of a call's /tmp and /proc (nosuid,nodev[,noexec])",
    "unshare": "of a user, PID, UTS, IPC, cgroup or time namespace",
    "setns": "into a user, PID, UTS, IPC, cgroup or time namespace, or of an unspecified type",
    "clone": "with CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUTS or CLONE_NEWCGROUP, or CLONE_NEWIPC "
             "without CLONE_NEWPID",
}


@dataclass(frozen=True)
class Filter:
    """`bpf`: the compiled program (struct sock_filter array) or None with `why` it is unavailable;
    `refused`: the system calls it refuses on this architecture; `skipped`: names libseccomp lacks."""

    bpf: bytes | None
    refused: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    why: str = ""


@functools.lru_cache(maxsize=1)
def compile_filter() -> Filter:
    """Compile the filter for this machine's architecture (once per process)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:   # pyseccomp raises RuntimeError without libseccomp
        return Filter(None, why=f"no seccomp filter: pyseccomp/libseccomp unavailable ({type(e).__name__}: {e})")
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
        try:   # a binary tree of system call numbers: shorter paths than a linear list
            f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
        except OSError:
            pass   # libseccomp < 2.5: a linear list, same verdicts
        arch = sc.system_arch()
        refused, skipped = [], []
        for name in REFUSED:
            if sc.resolve_syscall(arch, name) < 0:
                skipped.append(name)
                continue
            f.add_rule(sc.ERRNO(errno.EPERM), name)
            refused.append(name)
        _add_conditional(sc, f)
        if sc.resolve_syscall(arch, "clone3") >= 0:
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
            refused.append("clone3")
        with tempfile.TemporaryFile() as fh:
            f.export_bpf(fh)
            fh.seek(0)
            bpf = fh.read()
    except OSError as e:
        return Filter(None, why=f"no seccomp filter: libseccomp failed: {e}")
    if not bpf or len(bpf) % 8:
        return Filter(None, why=f"no seccomp filter: libseccomp exported {len(bpf)} bytes, not a BPF program")
    return Filter(bpf, tuple(refused), tuple(skipped))


def _add_conditional(sc, f) -> None:
    eperm = sc.ERRNO(errno.EPERM)
    lo, hi = min(CALL_MOUNT_FLAGS), max(CALL_MOUNT_FLAGS)
    f.add_rule(eperm, "mount", sc.Arg(3, sc.LT, lo))
    f.add_rule(eperm, "mount", sc.Arg(3, sc.GT, hi))
    for flags in range(lo + 1, hi):
        if flags not in CALL_MOUNT_FLAGS:
            f.add_rule(eperm, "mount", sc.Arg(3, sc.EQ, flags))
    for name in _OTHER_NS:
        f.add_rule(eperm, "unshare", sc.Arg(0, sc.MASKED_EQ, NS[name], NS[name]))
        f.add_rule(eperm, "setns", sc.Arg(1, sc.MASKED_EQ, NS[name], NS[name]))
    f.add_rule(eperm, "setns", sc.Arg(1, sc.EQ, 0))
    for name in ("CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWNET", "CLONE_NEWUTS", "CLONE_NEWCGROUP"):
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, NS[name], NS[name]))
    ipc_pid = NS["CLONE_NEWIPC"] | NS["CLONE_NEWPID"]   # a call's clone makes both; NEWIPC alone is refused
    f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, ipc_pid, NS["CLONE_NEWIPC"]))


def describe(filt: Filter) -> str:
    """One line for logs and `doctor`."""
    if filt.bpf is None:
        return filt.why
    extra = f"; unknown to this libseccomp, not filtered: {', '.join(filt.skipped)}" if filt.skipped else ""
    return (f"seccomp: {len(filt.refused)} system calls refused, mount/unshare/setns/clone in all but the forms the "
            f"call set-up uses (which need CAP_SYS_ADMIN){extra}")

