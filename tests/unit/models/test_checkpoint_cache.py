"""A remote checkpoint reaches a node once: the node's processes (engine actors, trainer ranks, the driver)
share one local copy under a lock, and reading the tokenizer downloads the tokenizer files only
(rstar2_core/models/io.py `_cached_copy`, `load_tokenizer`). Against a real S3 API (moto)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from s3_server import moto_s3

from rstar2_core import storage
from rstar2_core.models.io import local_checkpoint_dir

REGION, BUCKET = "eu-west-1", "rstar2-cache"
ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys, time
from rstar2_core import storage
from rstar2_core.models import io
storage.configure_s3(endpoint_url=sys.argv[1], region=sys.argv[2])
with open(sys.argv[4] + ".started", "a") as f:
    f.write("started\\n")
real = storage.download_dir
def counting(url, local_dir, select=None):
    with open(sys.argv[4], "a") as f:
        f.write("download\\n")
    deadline = time.monotonic() + 60    # the download lasts until all three started: the others wait on its lock
    while open(sys.argv[4] + ".started").read().count("started") < int(sys.argv[5]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return real(url, local_dir, select=select)
storage.download_dir = counting
print(io.local_checkpoint_dir(sys.argv[3]))
"""


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET, REGION) as endpoint:
        storage.configure_s3(endpoint_url=endpoint, region=REGION)
        yield endpoint


def test_the_processes_of_a_node_download_a_checkpoint_once(s3, tmp_path):
    url = f"s3://{BUCKET}/ckpt-a"
    storage.write_bytes_atomic(storage.join(url, "model.safetensors"), b"w" * 4096)
    storage.write_text_atomic(storage.join(url, "config.json"), "{}")
    storage.write_json_atomic(storage.join(url, storage.COMPLETE_MARKER), {"step": 1})
    log = tmp_path / "downloads.log"
    env = {**os.environ, "RSTAR2_HOME": str(tmp_path / "home")}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, s3, REGION, url, str(log), "3"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1                                    # one copy, the same folder for all three
    assert log.read_text().count("download") == 1             # downloaded by one process, the others waited
    copy = Path(paths.pop())
    assert (copy / "model.safetensors").read_bytes() == b"w" * 4096
    assert [p.name for p in copy.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_reading_the_tokenizer_downloads_no_weights(s3, toy_policy, tmp_path, monkeypatch):
    from rstar2_core.models.io import load_tokenizer

    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home"))
    url = f"s3://{BUCKET}/toy"
    fs, _ = storage.fs_for(url)
    fs.put(str(local_checkpoint_dir(toy_policy[0])), f"{BUCKET}/toy", recursive=True)
    tok = load_tokenizer(url)
    assert tok.decode(tok("Toy problem 3")["input_ids"]) == "Toy problem 3"
    cache = tmp_path / "home" / "cache"
    got = sorted(p.relative_to(cache).parts[0] for p in cache.rglob("*") if p.is_file() and ".lock" not in p.name)
    assert set(got) == {"tokenizers"}, got                    # no full checkpoint copy
    files = [p.name for p in (cache / "tokenizers").rglob("*") if p.is_file()]
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".pt"))], files
    assert "config.json" in files and "_COMPLETE" in files
