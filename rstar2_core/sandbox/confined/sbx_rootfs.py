"""The calls' minimal root, built once per template in its own mount namespace (standard library only;
loaded by template.py): a small tmpfs holding the host paths of the service's plan
(rstar2_core/sandbox/rootfs.py), each bind-mounted read-only (nosuid, nodev) at its own path or
copied where small, a minimal `/dev`, and empty `/proc` and `/tmp` on which each call mounts its own;
then `pivot_root` into it, detach the host's tree, and make the root itself read-only.

Invariant: the plan's paths under `/tmp` are built under `TMP_HOLD` (`/.tmp-host/...`) and linked from
each call's own `/tmp` (`tmp_links`), so that a call's tmpfs does not hide them. See docs/sandbox.md,
"How it works" (A minimal root per template).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat

libc = ctypes.CDLL(None, use_errno=True)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155 if os.uname().machine == "x86_64" else 41
DEVICES = {"null": (1, 3), "zero": (1, 5), "random": (1, 8), "urandom": (1, 9)}
DEV_LINKS = {"shm": "/tmp", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
# statvfs flags a bind inherits from its source; a user namespace may not clear them (locked flags)
_LOCKED = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
           (os.ST_RELATIME, MS_RELATIME))


def mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype or src} on {target}: {os.strerror(e)}")


def bind_readonly(src: str, target: str) -> None:
    mount(src, target, None, MS_BIND)
    st = os.statvfs(src)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(ms for stf, ms in _LOCKED if st.f_flag & stf)
    mount(None, target, None, flags)


TMP_HOLD = "/.tmp-host"


def inside(root: str, host: str) -> str:
    """Where host path `host` goes in the root built on `root`: its own path, or under TMP_HOLD for /tmp."""
    if host == "/tmp" or host.startswith("/tmp/"):
        return root + TMP_HOLD + host[len("/tmp"):]
    return root + host


def tmp_links(root: str) -> list[str]:
    """The entries a call links from its /tmp into TMP_HOLD (none when the plan has nothing under /tmp)."""
    hold = root + TMP_HOLD
    return sorted(os.listdir(hold)) if os.path.isdir(hold) else []


def build(new_root: str, binds: list[str], masks: list[str], copies: list[str] = ()) -> int:
    """Mount the root's tmpfs on `new_root` and fill it (see the module docstring): `binds` are
    bind-mounted, `copies` (small) copied. Returns the number of mounts made (each is copied into,
    and torn down with, every call's mount namespace)."""
    mount("rstar2-root", new_root, "tmpfs", MS_NOSUID, "size=8m,nr_inodes=8192,mode=755")
    done: set[str] = set()   # host paths already visible in the root
    for path in copies:
        _expose(new_root, path, done, copy=True)
    mounts = len(masks)
    for path in binds:
        mounts += _expose(new_root, path, done)
    for path in masks:
        mount("rstar2-mask", inside(new_root, path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=555")
    os.mkdir(f"{new_root}/dev", 0o755)
    for name, (major, minor) in DEVICES.items():
        node = f"{new_root}/dev/{name}"
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(node, 0o666)
        except PermissionError:   # a user namespace may not make device nodes: bind the host's
            open(node, "w").close()
            mount(f"/dev/{name}", node, None, MS_BIND)
            mounts += 1
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{new_root}/dev/{name}")
    for d in ("proc", "tmp"):
        os.mkdir(f"{new_root}/{d}", 0o755)
    # the root's own /tmp (what the template sees; each call mounts its own over it) links the plan's
    # paths under /tmp as calls do, so the template's preloads import from a checkout or venv there too
    for name in tmp_links(new_root):
        os.symlink(f"{TMP_HOLD}/{name}", f"{new_root}/tmp/{name}")
    return 1 + mounts


def pivot(new_root: str) -> None:
    """Make `new_root` this process's root, drop every host mount from its namespace, and remount the
    root read-only."""
    os.mkdir(f"{new_root}/.old")
    os.chdir(new_root)
    if libc.syscall(SYS_PIVOT_ROOT, b".", b".old") != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pivot_root: {os.strerror(e)}")
    os.chdir("/")
    if libc.umount2(b"/.old", MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount the host's root: {os.strerror(e)}")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _expose(root: str, path: str, done: set[str], copy: bool = False) -> int:
    """Make host `path` appear at the same path under `root` (bound, or copied when `copy`); returns
    the number of mounts made (0 or 1)."""
    parts = path.strip("/").split("/")
    cur = "/"
    hops = 0
    while parts:
        host = os.path.join(cur, parts.pop(0))
        if host in done:
            return 0   # already visible (bound or copied, itself or a directory above it)
        dest = inside(root, host)
        st = os.lstat(host)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(host)
            if not os.path.lexists(dest):
                os.symlink(target, dest)
            hops += 1
            if hops > 40:
                raise OSError(f"too many symlinks resolving {path}")
            parts = os.path.normpath(os.path.join(cur, target)).strip("/").split("/") + parts
            cur = "/"
            continue
        if parts:            # a directory on the way: an empty one in the root, whatever its mode
            if not os.path.isdir(dest):
                os.mkdir(dest, 0o755)
            cur = host
            continue
        done.add(host)
        if copy:
            if stat.S_ISDIR(st.st_mode):
                shutil.copytree(host, dest, symlinks=True)
            else:
                shutil.copy2(host, dest)
            return 0
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dest, 0o755)
        else:
            open(dest, "w").close()
        bind_readonly(host, dest)
        return 1
    return 0
