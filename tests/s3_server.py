"""A local S3 API for the tests: rstar2_cli/local_services.py's moto server on 127.0.0.1 with one bucket and
the AWS test credentials in the environment while it runs (what a Ray node started meanwhile inherits)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rstar2_cli.local_services import AWS_TEST_CREDENTIALS, moto_server

__all__ = ["AWS_TEST_CREDENTIALS", "moto_s3"]


@contextmanager
def moto_s3(bucket: str, region: str) -> Iterator[str]:
    """Start the server, create `bucket`; yields the endpoint URL. Leaves the process's S3 settings
    (`storage.configure_s3`) and environment as they were."""
    from rstar2_core import storage

    with moto_server(bucket, region) as endpoint:
        try:
            yield endpoint
        finally:
            storage.configure_s3()
