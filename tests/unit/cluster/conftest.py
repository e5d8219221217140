"""A local Ray (2 CPUs, small object store, short temp path) shared by the cluster tests; stopped at the end."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def local_ray():
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 object_store_memory=100 * 1024 * 1024, _node_ip_address="127.0.0.1",
                 _temp_dir=f"/tmp/rstar2-ray-cl-{os.getuid()}")
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture()
def ray_here(local_ray, request):
    """local_ray, with the requesting test module pickled by value (its actor classes then load in Ray
    workers, which cannot import test modules by name)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(request.module)
    yield local_ray


@pytest.fixture()
def kill_and_wait():
    return _kill_and_wait


def _kill_and_wait(ray, handle, timeout: float = 30.0) -> None:
    """`ray.kill(handle)` and return once the death is visible to callers. ray.kill is asynchronous: a
    call submitted right after it can still be answered by the live process, so a test that expects
    the next call to fail must wait for the kill to land first."""
    import time

    ray.kill(handle, no_restart=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"actor still answering {timeout:.0f} s after ray.kill")
