"""The machine's checkpoint cache is bounded (`storage.node_cache_max_gb`, rstar2_core/models/node_cache.py):
a download that would pass the bound first evicts the least recently used complete entries, never one a
process holds (its lock taken, here by another process) nor the one being downloaded; a bound below one
checkpoint is refused naming the setting. Small checkpoints on a real S3 API (moto), real cache files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_server import moto_s3

from rstar2_core import storage
from rstar2_core.config import ConfigError, load_config
from rstar2_core.models import node_cache
from rstar2_core.models.io import checkpoint_in_use, local_checkpoint_dir

REGION, BUCKET = "eu-west-1", "rstar2-node-cache"
ROOT = Path(__file__).resolve().parents[3]
SIZE = 10_000          # bytes of weights per fake checkpoint (+ a few bytes of config and marker)
HOLD = """
import sys, time
from pathlib import Path
from rstar2_core import storage
from rstar2_core.models.io import checkpoint_in_use
storage.configure_s3(endpoint_url=sys.argv[1], region=sys.argv[2])
with checkpoint_in_use(sys.argv[3]) as path:
    Path(sys.argv[4]).write_text(str(path))
    while not Path(sys.argv[5]).exists():
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def s3():
    with moto_s3(BUCKET, REGION) as endpoint:
        yield endpoint


@pytest.fixture
def cache(s3, tmp_path, monkeypatch):
    """This test's own cache (RSTAR2_HOME) and S3 settings, restored after."""
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home"))
    storage.configure_s3(endpoint_url=s3, region=REGION)
    yield tmp_path / "home" / "cache"
    storage.configure_s3()


def _checkpoint(name: str) -> str:
    url = f"s3://{BUCKET}/{name}"
    storage.write_bytes_atomic(storage.join(url, "model.safetensors"), name[:1].encode() * SIZE)
    storage.write_text_atomic(storage.join(url, "config.json"), "{}")
    storage.write_json_atomic(storage.join(url, storage.COMPLETE_MARKER), {"name": name})
    return url


def _cached(cache: Path) -> set[str]:
    """The checkpoints the cache holds complete, by the first letter of their weights."""
    return {(e.path / "model.safetensors").read_bytes()[:1].decode() for e in node_cache.entries()}


def test_the_least_recently_used_checkpoint_makes_room(cache):
    a, b, c = _checkpoint("a-ckpt"), _checkpoint("b-ckpt"), _checkpoint("c-ckpt")
    storage.set_node_cache_max_gb(2.5 * SIZE / 1e9)            # two checkpoints fit, not three
    local_checkpoint_dir(a)
    time.sleep(0.02)
    local_checkpoint_dir(b)
    time.sleep(0.02)
    with checkpoint_in_use(a):                                  # a read again: b is now the least recent
        pass
    assert _cached(cache) == {"a", "b"}
    time.sleep(0.02)
    path_c = local_checkpoint_dir(c)
    assert _cached(cache) == {"a", "c"} and (path_c / "model.safetensors").read_bytes() == b"c" * SIZE
    assert sum(e.bytes for e in node_cache.entries()) <= 2.5 * SIZE
    assert not [p for p in (cache / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert (local_checkpoint_dir(b) / "model.safetensors").read_bytes() == b"b" * SIZE   # evicted: fetched again


def test_a_checkpoint_another_process_reads_is_never_evicted(cache, s3, tmp_path):
    a, b = _checkpoint("h-held"), _checkpoint("n-new")
    storage.set_node_cache_max_gb(1.5 * SIZE / 1e9)             # room for one checkpoint only
    ready, release = tmp_path / "ready", tmp_path / "release"
    env = {**os.environ, "RSTAR2_HOME": os.environ["RSTAR2_HOME"]}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, s3, REGION, a, str(ready), str(release)], cwd=ROOT,
                              env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()
            time.sleep(0.05)
        path_b = local_checkpoint_dir(b)                       # over the bound: the held entry stays
        assert _cached(cache) == {"h", "n"}
        assert Path(ready.read_text()).joinpath("model.safetensors").read_bytes() == b"h" * SIZE
    finally:
        release.write_text("")
        holder.wait(timeout=60)
    assert holder.returncode == 0
    time.sleep(0.02)
    storage.set_node_cache_max_gb(1.5 * SIZE / 1e9)
    local_checkpoint_dir(_checkpoint("z-next"))                # released now: the least recent ones go
    assert _cached(cache) == {"z"} and not path_b.exists()


def test_a_bound_below_one_checkpoint_is_refused_naming_the_setting(cache):
    storage.set_node_cache_max_gb(0.5 * SIZE / 1e9)
    with pytest.raises(ConfigError, match="storage.node_cache_max_gb"):
        local_checkpoint_dir(_checkpoint("big-ckpt"))
    assert node_cache.entries() == []


def test_the_bound_is_a_storage_setting_that_reaches_the_actors():
    assert load_config("tiny").storage.node_cache_max_gb == storage.DEFAULT_NODE_CACHE_MAX_GB == 200.0
    assert load_config("tiny", ["storage.node_cache_max_gb=null"]).storage.node_cache_max_gb is None
    with pytest.raises(ConfigError, match="node_cache_max_gb"):
        load_config("tiny", ["storage.node_cache_max_gb=0"])
    try:
        storage.configure_from(load_config("tiny", ["storage.node_cache_max_gb=30"]).storage)
        sent = storage.s3_settings()                            # what an engine or trainer actor is given
        storage.configure_s3()
        assert storage.node_cache_max_bytes() == 200e9
        storage.configure_s3(**sent)
        assert storage.node_cache_max_bytes() == 30e9
    finally:
        storage.configure_s3()
