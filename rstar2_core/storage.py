"""Artifact store over fsspec URLs (file://, s3:// through s3fs) with atomic writes.

Files are written to a temporary name beside the target and renamed (local) or uploaded then
committed (object stores, where a PUT is atomic per object). Directories (checkpoints) are complete
only when their `_COMPLETE` marker exists; `write_dir_atomic` writes the marker last and readers
use `is_complete` / `latest_complete` to ignore half-written ones.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

COMPLETE_MARKER = "_COMPLETE"
_S3_OPTIONS: dict[str, Any] = {}


def configure_s3(endpoint_url: str | None = None, region: str | None = None) -> None:
    """Set s3fs client options for every s3:// URL this process opens afterwards (from StorageConfig).
    Process-wide: a Ray actor that reads or writes the store gets the driver's settings
    (`s3_settings()`) as a constructor argument and calls this first."""
    _S3_OPTIONS.clear()
    if endpoint_url or region:
        _S3_OPTIONS["client_kwargs"] = {k: v for k, v in
                                        (("endpoint_url", endpoint_url), ("region_name", region)) if v}


def s3_settings() -> dict[str, str]:
    """The arguments `configure_s3` was last given in this process ({} for none): what an actor on another
    node needs to reach the same S3 endpoint."""
    kw = _S3_OPTIONS.get("client_kwargs", {})
    return {k: v for k, v in (("endpoint_url", kw.get("endpoint_url")), ("region", kw.get("region_name"))) if v}


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
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    fs, path = fs_for(url)
    with fs.open(path, "rb") as f:
        return f.read()


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
    with fs.open(path, "wb") as f:  # one PUT: an object store never shows a partial object
        f.write(data)


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
    fs.put_file(str(local_file), path)


def write_text_atomic(url: str, text: str) -> None:
    write_bytes_atomic(url, text.encode("utf-8"))


def write_json_atomic(url: str, obj: Any) -> None:
    write_text_atomic(url, json.dumps(obj, indent=2, sort_keys=True, default=str))


def is_complete(dir_url: str) -> bool:
    return exists(join(dir_url, COMPLETE_MARKER))


def list_dirs(url: str) -> list[str]:
    """Immediate sub-directory URLs of `url` (empty when it does not exist)."""
    fs, path = fs_for(url)
    if not fs.exists(path):
        return []
    out = []
    for info in fs.ls(path, detail=True):
        if info.get("type") == "directory":
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append(join(url, name))
    return sorted(out)


@contextmanager
def staging_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rstar2-stage-"))
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
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(f), target)


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
        fs.rm(join(path, COMPLETE_MARKER))
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


def download_dir(url: str, local_dir: Path, select: Callable[[str], bool] | None = None) -> Path:
    """Copy a complete remote folder to `local_dir` (a local URL is returned as its own path); `select`:
    only the files whose path relative to the folder it accepts."""
    local = to_local_path(url)
    if local is not None:
        return local
    fs, path = fs_for(url)
    local_dir.mkdir(parents=True, exist_ok=True)
    for rpath in fs.find(path):
        rel = rpath[len(path.rstrip("/")) + 1:]
        if select is not None and not select(rel):
            continue
        dst = local_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(rpath, str(dst))
    return local_dir


def remove(url: str) -> None:
    fs, path = fs_for(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)
