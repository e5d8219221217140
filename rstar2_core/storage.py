"""Artifact store over fsspec URLs (file://, s3:// through s3fs) with atomic writes.

Files are written to a temporary name beside the target and renamed (local) or uploaded then
committed (object stores, where a PUT is atomic per object). Directories (checkpoints) are complete
only when their `_COMPLETE` marker exists; `write_dir_atomic` writes the marker last and readers
use `is_complete` / `latest_complete` to ignore half-written ones. A remote operation that cannot reach
its store (connection refused or reset, a timeout) is retried with backoff for `outage_retry_s` seconds
(`storage.outage_retry_s`), then raises `StoreUnavailable` (retryable). See docs/faults.md.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

from rstar2_core.errors import StoreUnavailable

COMPLETE_MARKER = "_COMPLETE"
_S3_OPTIONS: dict[str, Any] = {}
DEFAULT_OUTAGE_RETRY_S = 120.0          # StorageConfig.outage_retry_s's default
_OUTAGE_RETRY_S = DEFAULT_OUTAGE_RETRY_S
DEFAULT_NODE_CACHE_MAX_GB: float | None = 200.0     # StorageConfig.node_cache_max_gb's default
_NODE_CACHE_MAX_GB = DEFAULT_NODE_CACHE_MAX_GB
_UNSET: Any = object()
_RETRIES = {"n": 0}
_RETRIES_LOCK = threading.Lock()


def configure_s3(endpoint_url: str | None = None, region: str | None = None,
                 outage_retry_s: float | None = None, node_cache_max_gb: float | None = _UNSET) -> None:
    """Set s3fs client options for every s3:// URL this process opens afterwards (from StorageConfig), how
    long a remote operation waits out an unreachable store (`outage_retry_s`; None: the default) and the
    bound of this machine's checkpoint cache (`node_cache_max_gb`; None: none; not given: the default).
    Process-wide: a Ray actor that reads or writes the store gets the driver's settings
    (`s3_settings()`) as a constructor argument and calls this first."""
    global _OUTAGE_RETRY_S, _NODE_CACHE_MAX_GB
    _S3_OPTIONS.clear()
    if endpoint_url or region:
        _S3_OPTIONS["client_kwargs"] = {k: v for k, v in
                                        (("endpoint_url", endpoint_url), ("region_name", region)) if v}
    _OUTAGE_RETRY_S = DEFAULT_OUTAGE_RETRY_S if outage_retry_s is None else float(outage_retry_s)
    _NODE_CACHE_MAX_GB = DEFAULT_NODE_CACHE_MAX_GB if node_cache_max_gb is _UNSET else node_cache_max_gb


def set_node_cache_max_gb(gb: float | None) -> None:
    """The bound of this machine's checkpoint cache in this process (None: none; leaves the endpoint)."""
    global _NODE_CACHE_MAX_GB
    _NODE_CACHE_MAX_GB = gb


def node_cache_max_bytes() -> float | None:
    """The bound of this machine's checkpoint cache (rstar2_core/models/node_cache.py) in bytes; None: none."""
    return None if _NODE_CACHE_MAX_GB is None else _NODE_CACHE_MAX_GB * 1e9


def set_outage_retry_s(seconds: float) -> None:
    """How long a remote operation waits out an unreachable store in this process (leaves the endpoint)."""
    global _OUTAGE_RETRY_S
    _OUTAGE_RETRY_S = float(seconds)


@contextmanager
def outage_budget(seconds: float) -> Iterator[None]:
    """`outage_retry_s` set to `seconds` in this process for a block (preflight: a check must not wait)."""
    global _OUTAGE_RETRY_S
    before, _OUTAGE_RETRY_S = _OUTAGE_RETRY_S, float(seconds)
    try:
        yield
    finally:
        _OUTAGE_RETRY_S = before


def configure_from(section: Any) -> None:
    """`configure_s3` from a config's `storage` section (its endpoint, region, outage budget, cache bound)."""
    configure_s3(section.s3_endpoint_url, section.s3_region, section.outage_retry_s, section.node_cache_max_gb)


def s3_settings() -> dict[str, Any]:
    """The arguments `configure_s3` was last given in this process ({} for none): what an actor on another
    node needs to reach the same S3 endpoint, and wait out its outages as long."""
    kw = _S3_OPTIONS.get("client_kwargs", {})
    out: dict[str, Any] = {k: v for k, v in (("endpoint_url", kw.get("endpoint_url")),
                                             ("region", kw.get("region_name"))) if v}
    if _OUTAGE_RETRY_S != DEFAULT_OUTAGE_RETRY_S:
        out["outage_retry_s"] = _OUTAGE_RETRY_S
    if _NODE_CACHE_MAX_GB != DEFAULT_NODE_CACHE_MAX_GB:
        out["node_cache_max_gb"] = _NODE_CACHE_MAX_GB
    return out


def outage_retries() -> int:
    """How many remote operations this process retried because the store was unreachable."""
    return _RETRIES["n"]


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean a store did not answer (refused, reset, timed out), botocore's endpoint errors
    (no OSError) and fsspec's timeout included: what storage waits out and the pipeline's retry rule retries."""
    errs: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
        errs += (BotoConnectionError, HTTPClientError)
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError
        errs += (FSTimeoutError,)
    except ImportError:
        pass
    return errs


def _is_unreachable(exc: BaseException) -> bool:
    """The store did not answer (refused, reset, timed out), as opposed to an answer (missing key, denied)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, unreachable_errors()):
        return True
    cause = exc.__cause__ or exc.__context__
    return isinstance(exc, OSError) and cause is not None and cause is not exc and _is_unreachable(cause)


def _remote(what: str, url: str, fn: Callable[[], Any], gone_ok: bool = False) -> Any:
    """`fn()` (one idempotent remote operation: a whole object written, read, listed or removed), retried
    with exponential backoff (0.5 s doubling to 8 s) while the store is unreachable, for at most
    `outage_retry_s` seconds from the start of the first failed attempt (which includes the S3 client's
    own retries: ~15 s for a refused connection, minutes for a store that accepts connections and never
    answers); then `StoreUnavailable`. `gone_ok` (a removal): a retry that finds the object gone counts as
    done (the first attempt removed it and lost the answer)."""
    first, delay, tries = None, 0.5, 0
    while True:
        started = time.monotonic()
        try:
            return fn()
        except FileNotFoundError:
            if gone_ok and tries > 0:
                return None
            raise
        except Exception as e:
            if not _is_unreachable(e):
                raise
            first = started if first is None else first      # the client's own retries count as waiting
            waited = time.monotonic() - first
            if waited >= _OUTAGE_RETRY_S:
                raise StoreUnavailable(what, url, tries, waited, _OUTAGE_RETRY_S, e) from e
            tries += 1
            with _RETRIES_LOCK:
                _RETRIES["n"] += 1
            if tries == 1:
                print(f"WARNING: the store is unreachable ({type(e).__name__}: {str(e)[:200]}) while it {what} "
                      f"{url}; retrying for up to {_OUTAGE_RETRY_S:g} s (storage.outage_retry_s)", file=sys.stderr)
            time.sleep(min(delay, max(0.0, _OUTAGE_RETRY_S - waited)))
            delay = min(delay * 2, 8.0)


def fs_for(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for a URL or plain local path."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    opts = dict(_S3_OPTIONS) if protocol in ("s3", "s3a") else {}
    if protocol in ("s3", "s3a"):
        opts.setdefault("skip_instance_cache", False)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path


def join(url: str, *parts: str) -> str:
    out = url.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def to_local_path(url: str) -> Path | None:
    """Local path of a file:// URL or plain path; None for remote URLs."""
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    if "://" not in url:
        return Path(url)
    return None


def exists(url: str) -> bool:
    fs, path = fs_for(url)
    if to_local_path(url) is not None:
        return fs.exists(path)
    return _remote("checked", url, lambda: fs.exists(path))


def read_bytes(url: str) -> bytes:
    fs, path = fs_for(url)

    def read() -> bytes:
        with fs.open(path, "rb") as f:
            return f.read()

    return read() if to_local_path(url) is not None else _remote("read", url, read)


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


def write_bytes_atomic(url: str, data: bytes) -> None:
    fs, path = fs_for(url)
    local = to_local_path(url)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, local)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    def put() -> None:
        with fs.open(path, "wb") as f:  # one PUT: an object store never shows a partial object
            f.write(data)

    _remote("wrote", url, put)


def write_file_atomic(url: str, local_file: Path) -> None:
    """Publish a local file at `url` without reading it into memory: a local target is copied beside it
    and renamed into place; a remote one is one streamed upload (s3fs: a multipart upload past its block
    size, which the store shows only once complete)."""
    fs, path = fs_for(url)
    local = to_local_path(url)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(local_file, tmp)
            os.replace(tmp, local)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    _remote("uploaded", url, lambda: fs.put_file(str(local_file), path))


def write_text_atomic(url: str, text: str) -> None:
    write_bytes_atomic(url, text.encode("utf-8"))


def write_json_atomic(url: str, obj: Any) -> None:
    write_text_atomic(url, json.dumps(obj, indent=2, sort_keys=True, default=str))


def is_complete(dir_url: str) -> bool:
    return exists(join(dir_url, COMPLETE_MARKER))


def list_dirs(url: str) -> list[str]:
    """Immediate sub-directory URLs of `url` (empty when it does not exist)."""
    fs, path = fs_for(url)
    if not exists(url):
        return []
    infos = fs.ls(path, detail=True) if to_local_path(url) is not None else \
        _remote("listed", url, lambda: fs.ls(path, detail=True))
    out = []
    for info in infos:
        if info.get("type") == "directory":
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append(join(url, name))
    return sorted(out)


STAGING_PREFIX = "rstar2-stage-"
STALE_STAGING_S = 3600.0
"""A staging folder left by a process that is gone (killed mid-save: its `finally` never ran) is removed by
the next `staging_dir` on the machine once it is this old (a rank's folder holds its whole state: 770 MB
for the tests' SmolLM2 rank, ~90 GB for a 14B ZeRO-3 rank with Adam)."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                      # another user's process: alive
    return True


def sweep_stale_staging(root: Path | None = None, older_than_s: float = STALE_STAGING_S) -> list[Path]:
    """Remove `staging_dir` folders under `root` (the temp dir) whose process is gone and that are older than
    `older_than_s` (the age guards a process of another PID namespace sharing the folder); returns them."""
    gone = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*-*"):
        pid = d.name[len(STAGING_PREFIX):].split("-", 1)[0]
        try:        # the newest write anywhere inside: a live save keeps its folder young
            newest = max([d.stat().st_mtime] + [f.stat().st_mtime for f in d.rglob("*")])
        except FileNotFoundError:
            continue
        old = time.time() - newest > older_than_s
        if pid.isdigit() and old and not _process_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


@contextmanager
def staging_dir() -> Iterator[Path]:
    """A fresh local folder (named with this PID) removed on exit; first removes stale ones of dead processes."""
    sweep_stale_staging()
    d = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def upload_dir(local_dir: Path, url: str) -> None:
    """Copy a local folder's files to `url` (no marker)."""
    fs, path = fs_for(url)
    for f in sorted(Path(local_dir).rglob("*")):
        if f.is_file():
            rel = f.relative_to(local_dir).as_posix()
            target = f"{path.rstrip('/')}/{rel}"

            def put(f=f, target=target) -> None:
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(f), target)

            if to_local_path(url) is not None:
                put()
            else:
                _remote("uploaded", f"{url.rstrip('/')}/{rel}", put)


def copy_dir(src_url: str, dst_url: str, skip: set[str] = frozenset()) -> None:
    """Copy the files of folder `src_url` into `dst_url` (one filesystem; no marker), except the
    top-level names in `skip`: hard links on a local disk (a copy across devices), a server-side copy on
    an object store (S3's CopyObject: no byte passes through this process)."""
    (fs, src), (dst_fs, dst) = fs_for(src_url), fs_for(dst_url)
    if type(fs) is not type(dst_fs):
        raise ValueError(f"copy_dir copies within one filesystem: {src_url} -> {dst_url}")
    local = to_local_path(dst_url)
    for f in sorted(_remote("listed", src_url, lambda: fs.find(src))):
        rel = f[len(src.rstrip("/")) + 1:]
        if rel.split("/", 1)[0] in skip:
            continue
        target = f"{dst.rstrip('/')}/{rel}"
        if local is not None:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
        else:
            _remote("copied", f"{dst_url.rstrip('/')}/{rel}", lambda f=f, target=target: fs.copy(f, target))


def write_dir_atomic(local_dir: Path, url: str, meta: dict | None = None) -> None:
    """Publish a local folder at `url`: local targets are renamed into place; remote ones are
    uploaded file by file and the `_COMPLETE` marker (with `meta`) is written last."""
    staging = begin_dir(url)
    local = to_local_path(staging)
    try:
        if local is not None:
            shutil.copytree(local_dir, local, dirs_exist_ok=True)
        else:
            upload_dir(local_dir, staging)
        commit_dir(staging, url, meta)
    except BaseException:
        abort_dir(staging, url)        # a half-copied staging folder is not left beside the target
        raise


def begin_dir(url: str) -> str:
    """Start publishing a folder that several writers (processes, nodes) fill: returns the URL they write
    into. Local targets get a hidden sibling, renamed into place by `commit_dir`; remote ones are written
    in place (their `_COMPLETE` marker, removed here if present, is what makes them complete)."""
    local = to_local_path(url)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.parent / f".{local.name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        return tmp.as_uri()
    if exists(join(url, COMPLETE_MARKER)):
        fs, path = fs_for(url)
        _remote("removed", join(url, COMPLETE_MARKER), lambda: fs.rm(join(path, COMPLETE_MARKER)), gone_ok=True)
    return url


def commit_dir(staging_url: str, url: str, meta: dict | None = None) -> None:
    """Finish what `begin_dir(url)` started: write the `_COMPLETE` marker (with `meta`) last and, for a
    local target, rename the staging folder into place (replacing an older complete one)."""
    marker = json.dumps(meta or {}, sort_keys=True, default=str)
    local, tmp = to_local_path(url), to_local_path(staging_url)
    if local is not None and tmp is not None and tmp != local:
        (tmp / COMPLETE_MARKER).write_text(marker)
        if local.exists():
            old = local.parent / f".{local.name}.{uuid.uuid4().hex[:8]}.old"
            os.replace(local, old)
            os.replace(tmp, local)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, local)
        return
    write_text_atomic(join(url, COMPLETE_MARKER), marker)


def abort_dir(staging_url: str, url: str) -> None:
    """Drop a staging folder of `begin_dir` after a failure (a remote target stays incomplete)."""
    if staging_url != url:
        remove(staging_url)


def dir_bytes(url: str, select: Callable[[str], bool] | None = None) -> int:
    """Total size of the files under a folder (those `select(relative path)` keeps, when given)."""
    fs, path = fs_for(url)
    found = fs.find(path, detail=True) if to_local_path(url) is not None else \
        _remote("listed", url, lambda: fs.find(path, detail=True))
    base = len(path.rstrip("/")) + 1
    return sum(int(info.get("size") or 0) for rpath, info in found.items() if select is None or select(rpath[base:]))


def download_dir(url: str, local_dir: Path, select: Callable[[str], bool] | None = None) -> Path:
    """Copy a complete remote folder to `local_dir` (a local URL is returned as its own path); `select`:
    only the files whose path relative to the folder it accepts."""
    local = to_local_path(url)
    if local is not None:
        return local
    fs, path = fs_for(url)
    local_dir.mkdir(parents=True, exist_ok=True)
    for rpath in _remote("listed", url, lambda: fs.find(path)):
        rel = rpath[len(path.rstrip("/")) + 1:]
        if select is not None and not select(rel):
            continue
        dst = local_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        _remote("downloaded", f"{url.rstrip('/')}/{rel}", lambda rpath=rpath, dst=dst: fs.get_file(rpath, str(dst)))
    return local_dir


def remove(url: str) -> None:
    fs, path = fs_for(url)
    if exists(url):
        if to_local_path(url) is not None:
            fs.rm(path, recursive=True)
        else:
            _remote("removed", url, lambda: fs.rm(path, recursive=True), gone_ok=True)
