"""The machine's cache of remote checkpoints: `$RSTAR2_HOME/cache/<kind>/<key>`, each filled once per machine.

Every process of a node (engine actors, trainer ranks, the driver) reads a remote checkpoint through
`cached_copy`: the first downloads it under the entry's lock (`flock`, exclusive) into a temporary folder
renamed into place, the others wait and find it complete; a reader holds the lock shared while it uses the
entry. Invariant: the complete entries stay within `storage.node_cache_max_gb`: before a download that
would pass it, the least recently used complete entries are evicted, never one whose lock is held (in use
or being filled) nor the one being downloaded. See docs/models-and-sft.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rstar2_core import storage
from rstar2_core.config import ConfigError

log = logging.getLogger(__name__)
GB = 1e9


def cache_root() -> Path:
    home = os.environ.get("RSTAR2_HOME") or str(Path(__file__).resolve().parents[2] / ".rstar2")
    return Path(home) / "cache"


@contextlib.contextmanager
def node_lock(path: Path, shared: bool = False, wait: bool = True) -> Iterator[bool]:
    """A lock on `path` shared by every process of this machine (`flock`; exclusive unless `shared`). Yields
    True once held; with `wait=False` yields False at once when another holder conflicts. The kernel drops
    it when its holder dies, so a killed download leaves no stale lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def entry_key(url: str) -> str:
    """The cache key of a complete checkpoint: its URL and its marker (a republished checkpoint gets a new key)."""
    marker = storage.read_text(storage.join(url, storage.COMPLETE_MARKER))
    return hashlib.sha256((url + marker).encode()).hexdigest()[:16]


def _lock_of(entry: Path) -> Path:
    return entry.parent / f".{entry.name}.lock"


def _complete(entry: Path) -> bool:
    return (entry / storage.COMPLETE_MARKER).exists()


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float     # the entry folder's mtime, set on every use


def entries() -> list[Entry]:
    """The complete entries of every kind on this machine, least recently used first."""
    root = cache_root()
    found = [Entry(p, _bytes(p), p.stat().st_mtime) for kind in (root.iterdir() if root.is_dir() else [])
             if kind.is_dir() for p in kind.iterdir() if not p.name.startswith(".") and _complete(p)]
    return sorted(found, key=lambda e: e.last_used)


def partial_bytes(url: str, kind: str) -> int:
    """Bytes a download of `url`'s entry in progress on this machine has written so far (0 when none)."""
    key = entry_key(url)
    return sum(_bytes(p) for p in (cache_root() / kind).glob(f".{key}.*.tmp") if p.is_dir())


def make_room(incoming: int, max_bytes: float | None, keep: Path) -> list[Path]:
    """Evict least recently used complete entries until they and `incoming` bytes fit `max_bytes` (None: no
    bound). An entry whose lock is held (in use, being filled) and `keep` are never evicted; when those
    alone pass the bound the download goes ahead over it, with a warning. Returns the evicted folders."""
    if max_bytes is None:
        return []
    if incoming > max_bytes:
        raise ConfigError(f"storage.node_cache_max_gb = {max_bytes / GB:g} cannot hold a checkpoint of "
                          f"{incoming / GB:.1f} GB ({keep.name}): raise it above the largest checkpoint a node reads")
    evicted: list[Path] = []
    with node_lock(cache_root() / ".evict.lock"):          # one eviction pass at a time on this machine
        present = entries()
        total = sum(e.bytes for e in present)
        for e in present:
            if total + incoming <= max_bytes:
                break
            if e.path == keep:
                continue
            with node_lock(_lock_of(e.path), wait=False) as free:
                if not free or not _complete(e.path):
                    continue
                (e.path / storage.COMPLETE_MARKER).unlink()     # incomplete first: no reader takes it now
                shutil.rmtree(e.path, ignore_errors=True)
            total -= e.bytes
            evicted.append(e.path)
        if total + incoming > max_bytes:
            log.warning("node cache over its bound (storage.node_cache_max_gb = %g): %.1f GB of entries in use "
                        "and %.1f GB incoming", max_bytes / GB, total / GB, incoming / GB)
    return evicted


def _fill(url: str, dst: Path, select: Callable[[str], bool] | None) -> None:
    """Download `url` into `dst` (the caller holds its lock exclusively), making room first."""
    for stale in dst.parent.glob(f".{dst.name}.*.tmp"):   # what a killed download left: no one owns it now
        shutil.rmtree(stale, ignore_errors=True)
    make_room(storage.dir_bytes(url, select), storage.node_cache_max_bytes(), keep=dst)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    try:
        storage.download_dir(url, tmp, select=select)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dst, ignore_errors=True)     # a copy without its marker: an interrupted rename or eviction
    os.replace(tmp, dst)


@contextlib.contextmanager
def cached_copy(url: str, kind: str, select: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """The local copy of the complete remote checkpoint `url` (only the files `select(relative path)` keeps,
    when given), held in use (its lock shared) for the `with` block; downloaded first when the machine has
    none (see the module docstring). Marks the entry used now, for eviction's order."""
    dst = cache_root() / kind / entry_key(url)
    while True:
        with node_lock(_lock_of(dst), shared=True):
            if _complete(dst):
                os.utime(dst, (time.time(), time.time()))
                yield dst
                return
        with node_lock(_lock_of(dst)):
            if not _complete(dst):
                _fill(url, dst, select)
        # and read it under the shared lock (an eviction may have come between: then it is filled again)
