"""The remote model reaches each node apart from placement (rstar2_core/runtime/ray/model_prefetch.py): the
nodes with trainer shards or engines are the ones that download, a local model downloads nothing; on a
real Ray with a real S3 API (moto) a download fills the node's cache, one past
`cluster.model_download_timeout_s` raises ModelDownloadTimeout (retryable) naming the node and the bytes
that arrived, with the stalled download's process gone (its lock free), and the retry downloads it whole."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_core.config import load_config
from rstar2_core.runtime.ray.errors import ModelDownloadTimeout
from rstar2_core.runtime.ray.model_prefetch import model_needs
from rstar2_core.runtime.specs import layout_for

ROOT = Path(__file__).resolve().parents[4]


def test_the_nodes_with_trainer_shards_or_engines_need_the_model():
    layout = layout_for(load_config("qwen3-14b-mi300x"))
    url = "s3://rstar2-models/Qwen3-14B-Base"
    assert model_needs(layout, url, None) == {n: {url} for n in range(8)}
    engines = [f"s3://m/e{slot.index}" for slot in layout.engines]
    assert model_needs(layout, None, engines)[0] == {engines[s.index] for s in layout.engines if s.node == 0}
    assert model_needs(layout, "/data/Qwen3-14B-Base", None) == {}                    # local: nothing to fetch
    assert model_needs(layout, "file:///data/q", ["s3://m/q"] * len(layout.engines)) == {n: {"s3://m/q"}
                                                                                         for n in range(8)}


def test_the_timeout_names_the_node_and_the_bytes_and_is_pickled_whole():
    import pickle

    err = ModelDownloadTimeout("s3://m/q", {"node 1a2b3c4d (10.0.0.2)": (1234, 29_500_000_000)}, 1800)
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.nodes == err.nodes and isinstance(copy, TimeoutError)
    assert "1,234 of 29,500,000,000 bytes" in str(err) and "cluster.model_download_timeout_s" in str(err)
    with pytest.raises(ValueError, match="model_download_timeout_s"):
        load_config("tiny", ["cluster.model_download_timeout_s=0"])


@pytest.mark.slow
def test_download_timeout_and_retry_on_a_real_ray_and_store(tmp_path):
    env = {**os.environ, "RSTAR2_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    ray_tmp = f"/tmp/rstar2-ray-prefetch-{os.getpid()}"          # Ray's socket paths must stay short
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).with_name("prefetch_child.py")), ray_tmp],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["took"]) == 1 and out["took"][0].startswith("node ")
    assert len(out["cached"]) == 1 and out["cached"][0] > 50_000            # weights, config and marker
    t = out["timeout"]
    assert t["retried"] and 3 <= t["seconds"] < 60
    [(label, (arrived, total))] = t["nodes"].items()
    assert re.fullmatch(r"node [0-9a-f]{8} \(.+\)", label) and arrived == 1234 and total > 40_000
    assert "1,234 of" in t["message"] and "s3://rstar2-prefetch/stalled" in t["message"]
    assert out["lock_freed"] and out["tmp_left"] == []
    assert len(out["after_retry"]) == 2 and max(out["after_retry"]) >= 50_000
