"""A process killed mid-save leaves its staging folder (its `finally` never runs): the next `staging_dir`
on the machine removes it once it is an hour old, and never touches a live process's folder or a fresh one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rstar2_core import storage


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _folder(root, pid: int, age_s: float, tag: str = "abc123"):
    d = root / f"{storage.STAGING_PREFIX}{pid}-{tag}"
    d.mkdir()
    (d / "rank-state.pt").write_bytes(b"x" * 1000)
    t = time.time() - age_s
    for p in (d / "rank-state.pt", d):
        os.utime(p, (t, t))
    return d


def test_stale_folders_of_dead_processes_are_swept(tmp_path, monkeypatch):
    dead = _dead_pid()
    stale = _folder(tmp_path, dead, 2 * storage.STALE_STAGING_S)
    fresh = _folder(tmp_path, dead + 100_000, 10)                   # a dead process, but recent: kept
    live = _folder(tmp_path, os.getpid(), 2 * storage.STALE_STAGING_S)   # this process: kept however old
    other = tmp_path / "rstar2-stage-q7x_2z"                         # no PID in the name: not ours to judge
    other.mkdir()
    writing = _folder(tmp_path, dead, 2 * storage.STALE_STAGING_S, "w")  # an old folder, but a file written now
    (writing / "sub").mkdir()
    (writing / "sub" / "shard.pt").write_bytes(b"y")
    os.utime(writing, (time.time() - 2 * storage.STALE_STAGING_S,) * 2)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with storage.staging_dir() as d:
        assert d.parent == tmp_path and d.name.startswith(f"{storage.STAGING_PREFIX}{os.getpid()}-")
        assert not stale.exists() and fresh.exists() and live.exists() and other.exists() and writing.exists()
    assert not d.exists()
