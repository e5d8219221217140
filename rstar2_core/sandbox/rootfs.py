"""What the calls' minimal root holds: the host paths a template bind-mounts (or copies), read-only,
into the root it pivots into (confined/sbx_rootfs.py does the mounting). The plan is computed once
per service and handed to every template: the interpreter and standard library, the allowed packages
(the distributions `preload` and `heavy_modules` name, with what they require) and the shared
libraries all of that loads.

Invariant: nothing else of the host goes in (no site-packages beyond the allowed distributions, so
neither the project's editable install nor its `.pth` finder); a package outside the plan fails with
ModuleNotFoundError in a call. See docs/sandbox.md, "How it works" (A minimal root per template).
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata as md
import mmap
import os
import re
import struct
import sys
import sysconfig
from dataclasses import dataclass

COPY_MAX_BYTES = 512 << 10   # a bind mount costs ~7 us per call (copied and torn down with its namespace)
_SYSTEM_DIRS = ("/lib/{triplet}", "/usr/lib/{triplet}", "/lib64", "/usr/lib64", "/lib", "/usr/lib")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class RootPlan:
    """`binds`: host paths (files or directories) made visible at the same path; `masks`: directories
    inside a bound one replaced by an empty directory; `packages`: the allowed distributions;
    `notes`: what could not be resolved; `copies`: small files and directories (metadata, the
    interpreter's 20 KiB binary) copied into the root instead of bound, one mount fewer each."""

    binds: tuple[str, ...]
    masks: tuple[str, ...]
    packages: tuple[str, ...]
    notes: tuple[str, ...]
    copies: tuple[str, ...] = ()

    def to_settings(self) -> dict:
        return {"binds": list(self.binds), "masks": list(self.masks), "copies": list(self.copies)}


@functools.lru_cache(maxsize=8)
def plan_root(modules: tuple[str, ...]) -> RootPlan:
    """The plan for calls that may import the standard library and the distributions providing
    `modules` (top-level names; standard-library names are ignored)."""
    masks: list[str] = []
    notes: list[str] = []
    exe = sys.executable
    real_exe = os.path.realpath(exe)
    paths = {exe, real_exe}
    cfg = os.path.join(os.path.dirname(os.path.dirname(exe)), "pyvenv.cfg")
    if sys.prefix != sys.base_prefix and os.path.isfile(cfg):
        paths.add(cfg)
    stdlib = sysconfig.get_paths()["stdlib"]
    paths.add(stdlib)
    base_site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
    if sys.prefix != sys.base_prefix and base_site.startswith(stdlib + os.sep) and os.path.isdir(base_site):
        masks.append(base_site)
    dists, entries = _allowed_distributions(modules, notes)
    paths.update(entries)
    elves = [real_exe]
    for top in [stdlib, *entries]:
        if os.path.isdir(top):
            for dirpath, dirs, files in os.walk(top):
                dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in masks]
                elves += [os.path.join(dirpath, f) for f in files if ".so" in f]
        elif ".so" in top:
            elves.append(top)
    found, system_dirs = _library_closure(elves, notes)
    paths.update(found)
    paths.update(system_dirs)
    dirs = {p for p in paths if os.path.isdir(p) and not os.path.islink(p)}
    real_dirs = {os.path.realpath(p) for p in dirs}
    # a path through symlinks into a bound directory stays: the root gets those symlinks (/lib64/ld-linux...);
    # a canonical path inside a directory bound through a symlinked path (a venv reached through a link,
    # its libraries found by their real paths) is shown by that bind already
    binds = [p for p in paths if os.path.lexists(p) and not _under(p, dirs)
             and not (os.path.realpath(p) == p and _under(p, real_dirs))]
    # directories first: a file whose real path lies in a bound directory is then seen through it
    binds.sort(key=lambda p: (not (os.path.isdir(p) and not os.path.islink(p)), p))
    copies = [p for p in binds if not os.path.islink(p) and _small(p)]
    binds = [p for p in binds if p not in copies]
    return RootPlan(tuple(binds), tuple(masks), tuple(sorted(dists)), tuple(notes), tuple(copies))


def _small(path: str) -> bool:
    """Whether `path` (a file or a tree) holds at most COPY_MAX_BYTES; stops reading once it is over."""
    if not os.path.isdir(path):
        return os.path.getsize(path) <= COPY_MAX_BYTES
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
            if total > COPY_MAX_BYTES:
                return False
    return True


def _under(path: str, dirs: set[str]) -> bool:
    """Whether `path` lies inside one of `dirs` (so binding that directory already shows it)."""
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent):
        if parent in dirs:
            return True
        parent = os.path.dirname(parent)
    return False


# ------------------------------------------------------------------------------------ packages
def _allowed_distributions(modules: list[str], notes: list[str]) -> tuple[set[str], set[str]]:
    """Distribution names and the top-level site-packages entries they install."""
    by_module = md.packages_distributions()
    todo = [d for m in modules if m.split(".")[0] not in sys.stdlib_module_names
            for d in by_module.get(m.split(".")[0], [])]
    seen: set[str] = set()
    entries: set[str] = set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            notes.append(f"required distribution {name!r} is not installed")
            continue
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            path = os.path.normpath(str(dist.locate_file(top)))
            if os.path.lexists(path):
                entries.add(path)
        for req in dist.requires or []:
            if "extra ==" in req.replace("extra==", "extra =="):
                continue
            m = _REQ_NAME.match(req)
            if m:
                todo.append(m.group(1))
    return seen, entries


# ------------------------------------------------------------------------------ shared libraries
def _library_closure(files: list[str], notes: list[str]) -> tuple[set[str], set[str]]:
    """Every library the ELF objects in `files` load, transitively: (the RPATH/RUNPATH-resolved files and
    the program interpreter, the system library directories that hold the others)."""
    dirs = _system_dirs()
    out: set[str] = set()
    used_dirs: set[str] = set()
    todo = list(files)
    seen: set[str] = set()
    missing: set[str] = set()
    while todo:
        f = todo.pop()
        real = os.path.realpath(f)
        if real in seen:
            continue
        seen.add(real)
        info = _elf_dynamic(real)
        if info is None:
            continue
        needed, search, interp = info
        if interp:
            out.add(interp)
            todo.append(interp)
        origin = os.path.dirname(real)
        search = [s.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for s in search]
        for name in needed:
            where = name if "/" in name else next(
                (d for d in [*search, *dirs] if os.path.exists(os.path.join(d, name))), None)
            if where is None:
                missing.add(name)
                continue
            hit = where if "/" in name else os.path.join(where, name)
            if "/" not in name and where not in search:
                used_dirs.add(os.path.realpath(where))
            else:
                out.add(os.path.normpath(hit))
            todo.append(hit)
    # The loader also reuses a library already loaded under that name (its SONAME): a dependency of a
    # bundled library that only its loader's RUNPATH finds.
    missing -= {os.path.basename(p) for p in seen}
    if missing:
        notes.append("libraries not found (calls that load them fail): " + ", ".join(sorted(missing)))
    return out, used_dirs


def _system_dirs() -> list[str]:
    triplet = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    dirs = []
    for conf in ["/etc/ld.so.conf", *sorted(glob.glob("/etc/ld.so.conf.d/*.conf"))]:
        try:
            with open(conf) as fh:
                dirs += [ln.strip() for ln in fh if ln.strip().startswith("/")]
        except OSError:
            pass
    dirs += [d.format(triplet=triplet) for d in _SYSTEM_DIRS]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.isdir(d)]


def _elf_dynamic(path: str) -> tuple[list[str], list[str], str | None] | None:
    """(DT_NEEDED names, RUNPATH or RPATH directories, PT_INTERP) of a 64-bit little-endian ELF object,
    or None when `path` is not one."""
    try:
        with open(path, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)  # only the pages read are loaded
    except (OSError, ValueError):
        return None
    with data:
        return _parse_dynamic(data)


def _parse_dynamic(data: mmap.mmap) -> tuple[list[str], list[str], str | None] | None:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads, dynamic, interp = [], None, None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
        elif p_type == 3:
            interp = data[p_offset:p_offset + p_filesz].split(b"\0")[0].decode()
    if dynamic is None:
        return [], [], interp
    tags: list[tuple[int, int]] = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        tags.append((tag, val))
    strtab = next((v for t, v in tags if t == 5), None)
    if strtab is None:
        return [], [], interp
    base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
    if base is None:
        return None

    def string(i: int) -> str:
        return data[base + i:data.find(b"\0", base + i)].decode()

    needed = [string(v) for t, v in tags if t == 1]
    runpath = [string(v) for t, v in tags if t == 29]
    rpath = [string(v) for t, v in tags if t == 15]
    search = [d for s in (runpath or rpath) for d in s.split(":") if d]
    return needed, search, interp
