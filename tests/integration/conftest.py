"""One service stack (deployment_services.Stack) for every test of this package: started at the first test
that asks for it, stopped after the last; each test gets it clean, with RSTAR2_HOME, RSTAR2_CONFIG_DIR and
Prefect's API URL pointing at it."""

from __future__ import annotations

import os
import shutil

import pytest
from deployment_services import stack_up


@pytest.fixture(scope="package")
def _services(tmp_path_factory):
    ray_tmp = f"/tmp/rstar2-ray-e2e-{os.getpid()}"        # a Ray client's socket paths must stay short
    try:
        with stack_up(tmp_path_factory.mktemp("services"), RSTAR2_RAY_TMP=ray_tmp) as stack:
            yield stack
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture
def stack(_services, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv("RSTAR2_HOME", str(_services.home))
    monkeypatch.setenv("RSTAR2_CONFIG_DIR", str(_services.profiles))
    _services.begin()
    try:
        with temporary_settings({PREFECT_API_URL: _services.api}):
            yield _services
    finally:
        _services.clean()
