"""A TCP endpoint in front of a real server that a test takes down and brings back: `down()` closes the
listening port (new connections are refused, as by a stopped server) and resets every open connection
(a request in flight dies mid-transfer); `up()` listens on the same port again. The server behind it
keeps its state, so a test can stop "the store" for 30 s without losing what was written before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rstar2_cli.local_services import FlakyEndpoint


@contextmanager
def in_front_of(server_url: str, region: str) -> Iterator[FlakyEndpoint]:
    """A FlakyEndpoint in front of the server at `server_url` (a moto S3); closed after, and this process's
    S3 settings (`storage.configure_s3`) pointed back at the server."""
    from rstar2_core import storage

    ep = FlakyEndpoint("127.0.0.1", int(server_url.rsplit(":", 1)[1]))
    try:
        yield ep
    finally:
        ep.close()
        storage.configure_s3(server_url, region)
