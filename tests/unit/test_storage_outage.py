"""storage's outage rule against a real S3 API (moto) behind an endpoint the test closes: past
`outage_retry_s` an unreachable store raises `StoreUnavailable` (retryable) naming the object, the wait and
the setting; an answer of the store (a missing key) is never retried. A 30 s outage waited out during an RL
stage's checkpoint is tests/integration/test_store_outage.py."""

from __future__ import annotations

import time

import pytest
from flaky_endpoint import in_front_of
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
    with in_front_of(moto_url, REGION) as ep:
        yield ep


@pytest.mark.slow
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


def test_a_removal_retried_after_its_answer_was_lost_counts_as_done():
    """The first attempt removed the object and its answer was lost (a reset): the retry finds it gone,
    which for a removal is success; for a read it is the store's answer, raised."""
    answers = iter([ConnectionResetError(104, "Connection reset by peer"), FileNotFoundError("s3://b/k")])

    def rm():
        raise next(answers)

    assert storage._remote("removed", "s3://b/k", rm, gone_ok=True) is None
    answers = iter([ConnectionResetError(104, "Connection reset by peer"), FileNotFoundError("s3://b/k")])
    with pytest.raises(FileNotFoundError):
        storage._remote("read", "s3://b/k", rm)
