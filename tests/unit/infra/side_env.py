"""Side Python environments for version tests, built once and cached under $RSTAR2_HOME/cache/side-envs.

`side_python(name, packages)` returns the interpreter of a venv that sees this project's torch installation
(symlinks to torch and the distributions it requires, in a folder a .pth file puts on the venv's path:
the very build the project runs, nothing copied or downloaded) and holds `packages` from the package index,
e.g. another transformers release, installed with uv: from uv's wheel cache alone first (`--offline`; the
cache is $XDG_CACHE_HOME/uv, the checkout's .rstar2/cache/uv), from the package index when the cache lacks
them (pip where uv is missing). What the venv installs
comes first on its path, so a package it pins shadows the project's copy. The venv is built in a
temporary folder and renamed into place when complete, so an interrupted build is never reused; another
package list, torch version or project venv gets a fresh one. Copying torch in with pip instead (the wheel
from disk) took 62-135 s of the 2-core machine per fresh clone. Packages neither in the cache nor reachable
on the index fail the test with a message that says so (never a skip); so does any other install failure.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]


def _cache_root() -> Path:
    # tests/conftest.py points RSTAR2_HOME at a per-session folder; XDG_CACHE_HOME keeps the checkout's
    # $RSTAR2_HOME/cache (scripts/env.sh sets both to the same folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or ROOT / ".rstar2" / "cache") / "side-envs"


def _index_reachable(url: str = "https://pypi.org/simple/pip/") -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def _torch_entries() -> set[str]:
    """The top-level entries of this interpreter's site-packages (packages, modules, .dist-info folders)
    that torch and every distribution it requires (extras off) installed."""
    entries: set[str] = set()
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:       # a requirement torch's metadata names but this venv lacks
            continue
        entries |= {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return entries


def _link_torch(home: Path, site: Path) -> None:
    """Symlink torch and what it requires into home/project-torch and put that folder on the venv's path (a .pth line
    relative to its site-packages, so the venv still works once renamed)."""
    src = Path(sysconfig.get_paths()["purelib"])
    links = home / "project-torch"
    links.mkdir()
    for entry in _torch_entries():
        if (src / entry).exists():
            (links / entry).symlink_to(src / entry)
    (site / "project-torch.pth").write_text(os.path.relpath(links, site) + "\n")


def _uv() -> Path | None:
    uv = Path(sys.executable).with_name("uv")
    return uv if uv.exists() else None


def _install(py: Path, packages: list[str], offline: bool = False) -> subprocess.CompletedProcess:
    uv = _uv()
    cmd = ([str(uv), "pip", "install", "-q", "--python", str(py), *(["--offline"] if offline else [])] if uv else
           [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"])
    return subprocess.run(cmd + packages, capture_output=True, text=True, check=False)


def _uv_cache_dir() -> str:
    uv = _uv()
    if uv is None:
        return "(no uv next to this interpreter: run make setup)"
    return subprocess.run([str(uv), "cache", "dir"], capture_output=True, text=True, check=False).stdout.strip()


def side_python(name: str, packages: list[str]) -> Path:
    spec = [f"torch=={md.version('torch')} at {sysconfig.get_paths()['purelib']}", *packages]
    key = hashlib.sha256("\n".join(spec).encode()).hexdigest()[:12]
    home = _cache_root() / f"{name}-{key}"
    py = home / "bin" / "python"
    if (home / "COMPLETE").is_file() and py.exists() and (home / "project-torch" / "torch").exists():
        return py
    tmp = home.with_name(home.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True)
    site = subprocess.run([str(tmp / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    _link_torch(tmp, Path(site))
    proc = _install(tmp / "bin" / "python", packages, offline=True) if _uv() else None
    if proc is None or proc.returncode != 0:                  # not all in uv's cache: ask the index
        proc = _install(tmp / "bin" / "python", packages)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _index_reachable():
            pytest.fail(f"the side environment {name} cannot be built: uv's wheel cache ({_uv_cache_dir()}) "
                        f"lacks some of {' '.join(packages)} and the package index (PyPI) is unreachable. "
                        f"Run this test once on a machine with network (it fills the cache), or copy a filled "
                        f"cache there.\n{proc.stderr[-1000:]}", pytrace=False)
        raise RuntimeError(f"installing {' '.join(packages)} failed in the side environment {name}:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    (tmp / "COMPLETE").write_text("\n".join(spec) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    tmp.rename(home)
    return home / "bin" / "python"
