"""Run by test_model_prefetch.py in a process of its own: a moto S3 server, then a fresh local Ray started
with its test credentials in the environment (so Ray's workers can read the store), and the model
prefetch's three paths on the layout's node: a real download, a download past the timeout (a fetch that
writes part of the checkpoint and stalls), a retry after it. Prints one JSON line of what it saw.

    python tests/unit/runtime/ray/prefetch_child.py <ray temp dir>
"""

from __future__ import annotations

import json
import sys
import time


def stalled_fetch(url: str, settings: dict) -> int:
    """A download that writes 1234 bytes of `url` where a real one would, under the entry's lock, and stalls."""
    import os

    from rstar2_core import storage
    from rstar2_core.models import node_cache

    storage.configure_s3(**settings)
    key = node_cache.entry_key(url)
    with node_cache.node_lock(node_cache.cache_root() / "checkpoints" / f".{key}.lock"):
        tmp = node_cache.cache_root() / "checkpoints" / f".{key}.{os.getpid()}.tmp"
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"p" * 1234)
        time.sleep(600)
    return 0


def main(ray_tmp: str) -> dict:
    import ray

    from rstar2_cli.local_services import moto_server
    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.models import node_cache
    from rstar2_core.runtime.ray.errors import ModelDownloadTimeout
    from rstar2_core.runtime.ray.model_prefetch import prefetch_models
    from rstar2_core.runtime.ray.placement import ActorGroup
    from rstar2_core.runtime.specs import layout_for
    from tasks import retry

    out: dict = {}
    with moto_server("rstar2-prefetch", "eu-west-1") as endpoint:
        storage.configure_s3(endpoint, "eu-west-1")
        url = "s3://rstar2-prefetch/policy"
        storage.write_bytes_atomic(storage.join(url, "model.safetensors"), b"w" * 50_000)
        storage.write_text_atomic(storage.join(url, "config.json"), "{}")
        storage.write_json_atomic(storage.join(url, storage.COMPLETE_MARKER), {"step": 0})
        stalled = "s3://rstar2-prefetch/stalled"
        storage.write_bytes_atomic(storage.join(stalled, "model.safetensors"), b"s" * 40_000)
        storage.write_json_atomic(storage.join(stalled, storage.COMPLETE_MARKER), {"step": 0})
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 object_store_memory=100 * 1024 * 1024, _node_ip_address="127.0.0.1", _temp_dir=ray_tmp)
        group = ActorGroup(layout_for(load_config("tiny")), timeout_s=120, prefix="t-prefetch-")
        try:
            took = prefetch_models(group, {0: {url}}, timeout_s=120)
            out["took"] = sorted(took)
            out["cached"] = [e.bytes for e in node_cache.entries()]
            t0 = time.monotonic()
            try:
                prefetch_models(group, {0: {stalled}}, timeout_s=3, fetch=stalled_fetch)
            except ModelDownloadTimeout as e:
                out["timeout"] = {"message": str(e), "nodes": e.nodes, "seconds": time.monotonic() - t0,
                                  "retried": retry.is_infrastructure_error(e)}
            lock = node_cache.cache_root() / "checkpoints" / f".{node_cache.entry_key(stalled)}.lock"
            deadline, freed = time.monotonic() + 30, False
            while not freed and time.monotonic() < deadline:    # the stalled task's process was killed
                with node_cache.node_lock(lock, wait=False) as freed:
                    pass
                time.sleep(0.2)
            out["lock_freed"] = freed
            prefetch_models(group, {0: {stalled}}, timeout_s=120)              # the retry: a real download
            out["after_retry"] = sorted(e.bytes for e in node_cache.entries())
            out["tmp_left"] = [p.name for p in (node_cache.cache_root() / "checkpoints").iterdir()
                               if p.name.endswith(".tmp")]
        finally:
            group.shutdown()
            ray.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
