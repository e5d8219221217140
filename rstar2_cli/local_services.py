"""Local servers that tests and benchmarks stop and start as a cluster's services go away and come back:
a moto S3 (`moto_server`), an endpoint in front of a server that closes and reopens (`FlakyEndpoint`: the
server behind it keeps its state), an `mlflow server` and a `prefect server` on SQLite, each stopped by
PID and started again on the same port and database. 127.0.0.1 only. docs/faults.md."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rstar2_cli.rehearsal_stack import free_port, wait_http

AWS_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@contextmanager
def moto_server(bucket: str, region: str) -> Iterator[str]:
    """A moto S3 server with `bucket`, moto's test credentials in this process's environment while it runs
    (what a Ray node or a driver started meanwhile inherits); yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # not a line per request
    port = free_port()
    saved = {k: os.environ.get(k) for k in (*AWS_TEST_CREDENTIALS, "AWS_DEFAULT_REGION")}
    os.environ.update({**AWS_TEST_CREDENTIALS, "AWS_DEFAULT_REGION": region})
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name=region).create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": region})
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.root / "mlflow.log", "ab") as log:      # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                 "--default-artifact-root", (self.root / "artifacts").as_uri()],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                     "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_http(f"{self.uri}/health", "MLflow tracking server", 180, self.proc, self.root / "mlflow.log")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


class PrefectServer:
    """`prefect server start` on SQLite under `root` (the API the flow, its tasks on Ray and this script use)."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.proc = None

    def __enter__(self):
        log = self.root / "prefect-server.log"
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                                          "127.0.0.1", "--port", str(self.port)], stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "PREFECT_API_URL": self.api})
        wait_http(f"{self.api}/health", "Prefect server", 240, self.proc, log)
        from prefect.settings import PREFECT_API_URL, temporary_settings

        os.environ["PREFECT_API_URL"] = self.api           # for processes started from now on (Ray's)
        self._settings = temporary_settings({PREFECT_API_URL: self.api})   # this process read its settings
        self._settings.__enter__()
        return self

    def __exit__(self, *exc):
        self._settings.__exit__(None, None, None)
        os.environ.pop("PREFECT_API_URL", None)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
