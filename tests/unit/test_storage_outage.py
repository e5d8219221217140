"""storage's outage rule against a real S3 API (moto) behind an endpoint the test closes: an unreachable
store is waited out for `outage_retry_s`, then `StoreUnavailable` (retryable) names the object, the wait
and the setting; an answer of the store (a missing key) is never retried."""

from __future__ import annotations

import threading
import time

import pytest
from flaky_endpoint import FlakyEndpoint
from s3_server import moto_s3

from rstar2_core import storage
from rstar2_core.errors import StoreUnavailable
from tasks.retry import is_infrastructure_error

REGION, BUCKET = "eu-west-1", "rstar2-flaky"


@pytest.fixture(scope="module")
def moto_url():
    with moto_s3(BUCKET, REGION) as url:
        yield url


@pytest.fixture
def endpoint(moto_url):
    ep = FlakyEndpoint("127.0.0.1", int(moto_url.rsplit(":", 1)[1]))
    try:
        yield ep
    finally:
        ep.close()
        storage.configure_s3(moto_url, REGION)


@pytest.mark.slow
def test_a_store_away_for_20_s_is_waited_out(endpoint):
    """20 s: longer than botocore's own retries of a refused connection (legacy mode: 5 attempts, at most
    ~15 s), so the wait is storage's."""
    storage.configure_s3(endpoint.url, REGION, outage_retry_s=60)
    url = f"s3://{BUCKET}/a/obj.bin"
    storage.write_bytes_atomic(url, b"before")
    before = storage.outage_retries()
    endpoint.down()
    threading.Timer(20.0, endpoint.up).start()
    t0 = time.monotonic()
    storage.write_bytes_atomic(url, b"during")          # waits for the endpoint, then writes
    assert time.monotonic() - t0 >= 19
    assert storage.outage_retries() > before
    assert storage.read_bytes(url) == b"during"
    assert storage.s3_settings()["outage_retry_s"] == 60  # what an actor on another node is given


def test_past_the_budget_the_error_is_retryable_and_names_the_setting(endpoint):
    storage.configure_s3(endpoint.url, REGION, outage_retry_s=2)
    endpoint.down()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        storage.read_bytes(f"s3://{BUCKET}/b/obj.bin")
    assert 2 <= time.monotonic() - t0 < 60
    assert is_infrastructure_error(err.value)
    msg = str(err.value)
    assert f"s3://{BUCKET}/b/obj.bin" in msg and "storage.outage_retry_s = 2 s" in msg, msg


def test_an_answer_of_the_store_is_not_an_outage(endpoint):
    storage.configure_s3(endpoint.url, REGION, outage_retry_s=60)
    before = storage.outage_retries()
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"s3://{BUCKET}/missing/obj.bin")
    assert storage.outage_retries() == before
