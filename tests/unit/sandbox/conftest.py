"""A sandbox shared by the tests of a module (templates start once), with short limits."""

from __future__ import annotations

import pytest

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox import LocalSandbox


def small_cfg(**kw) -> SandboxConfig:
    base = {"workers": 2, "timeout_s": 2.0, "cpu_time_s": 4.0, "memory_mb": 256}
    base.update(kw)
    return SandboxConfig(**base)


@pytest.fixture()
def make_cfg():
    return small_cfg


@pytest.fixture(scope="module")
def sb():
    box = LocalSandbox(small_cfg()).start()
    yield box
    box.close()


@pytest.fixture()
def light_only():
    """A sandbox with only the light template (starts in well under a second)."""
    box = LocalSandbox(small_cfg(preload=["math"])).start()
    yield box
    box.close()
