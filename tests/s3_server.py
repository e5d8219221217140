"""A local S3 API for the tests: a moto server on 127.0.0.1 with one bucket, and the AWS test credentials
in the environment while it runs (what a Ray node started meanwhile, or a driver process, inherits)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

AWS_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@contextmanager
def moto_s3(bucket: str, region: str) -> Iterator[str]:
    """Start the server, create `bucket`; yields the endpoint URL. Leaves the process's S3 settings
    (`storage.configure_s3`) and environment as they were."""
    from moto.server import ThreadedMotoServer

    from rstar2_core import storage

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = pytest.MonkeyPatch()
    for k, v in {**AWS_TEST_CREDENTIALS, "AWS_DEFAULT_REGION": region}.items():
        env.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name=region).create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})
        yield endpoint
    finally:
        storage.configure_s3()
        server.stop()
        env.undo()
