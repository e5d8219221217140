"""The cluster tests' helpers over the session's local Ray (`local_ray`, tests/conftest.py)."""

from __future__ import annotations

import pytest


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
