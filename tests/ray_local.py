"""One local Ray for a test session or module: 2 CPUs, a small object store, 127.0.0.1, its own temp folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def local_ray_session(tag: str, **init: object) -> Iterator[None]:
    """Starts Ray unless one is up (then leaves it be); on exit stops what it started and removes its temp
    folder, `/tmp/rstar2-ray-<tag>-<pid>` (one per pytest process: two suites on one machine do not share
    Ray's session links). `init` overrides `ray.init` arguments (a script of its own may ask for logical
    GPUs: `num_gpus=4`). A raylet that misses Ray's 30 s registration window on a loaded 2-core host is
    started once more; any other start failure is raised as is."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray_tmp = f"/tmp/rstar2-ray-{tag}-{os.getpid()}"
    for attempt in range(2):
        try:
            ray.init(**{"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, "configure_logging": False,
                        "object_store_memory": 100 * 1024 * 1024, "_node_ip_address": "127.0.0.1",
                        "_temp_dir": ray_tmp, **init})
            break
        except Exception as e:
            ray.shutdown()
            if attempt or "timed out during startup" not in str(e):
                raise
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
