"""A TCP endpoint in front of a real server that a test takes down and brings back: `down()` closes the
listening port (new connections are refused, as by a stopped server) and resets every open connection
(a request in flight dies mid-transfer); `up()` listens on the same port again. The server behind it
keeps its state, so a test can stop "the store" for 30 s without losing what was written before."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager


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


class FlakyEndpoint:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.downs = 0
        self.up()

    # --------------------------------------------------------------------------------------------- state
    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", self.port))
            ls.listen(128)
            self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        """Close the port and reset every open connection (RST, not a clean close)."""
        with self._lock:
            ls, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
            self.downs += 1
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ls.close()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
            except OSError:
                pass

    def close(self) -> None:
        self.down()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    # ------------------------------------------------------------------------------------------ plumbing
    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return                                   # the listener was closed: down()
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not ls:             # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
