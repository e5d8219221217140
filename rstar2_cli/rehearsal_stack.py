"""The production service stack, started on this machine as infra/ describes it (the rehearsal's).
    with ServiceStack(root) as stack:         # every server on 127.0.0.1, stopped by PID on exit
        stack.prefect_api, stack.tracking_uri, stack.s3_endpoint, stack.cluster.address

PostgreSQL (for Prefect and MLflow), a moto S3 server with the profile's buckets, the MLflow tracking
server with S3 artifacts, the Prefect server, a worker started as infra/k8s/raycluster.yaml's `prefect-worker`
container (`deploy()`: the pool and deployments by `rstar2 deploy`'s code), a local multi-node Ray cluster and,
for a profile whose sandbox is the tool service, a tool node with the service deployed by `rstar2 tools deploy`.
Invariant: only the addresses (127.0.0.1 ports), the state folders (under `root`) and the S3 credentials
(moto's test keys) differ from production; no RSTAR2_REPO of ours reaches the worker.
See docs/rehearsal.md, "Rehearsing the production profile".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
BUCKETS = ("rstar2-models", "rstar2-data", "rstar2-artifacts", "rstar2-mlflow")
REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rehearsal", "AWS_SECRET_ACCESS_KEY": "rehearsal"}
"""moto's keys, standing for the `rstar2-s3` secret the production pods read (envFrom)."""
POOL = "rstar2-cluster"
IMAGE_WORKDIR = "/opt/rstar2"
"""Where the production image holds the code (infra/docker WORKDIR); this checkout stands for it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def pg_bin(name: str) -> str:
    """A PostgreSQL server program of Debian's package (the newest installed major version)."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise FileNotFoundError(f"PostgreSQL's {name} not found under /usr/lib/postgresql: `make setup` installs "
                                "Debian's postgresql package (apt-get install postgresql)")
    return str(found[-1])


def wait_http(url: str, what: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                r.read()
            return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering at {url}:\n{tail}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} did not answer at {url} within {timeout_s:.0f} s (log: {log})")
        time.sleep(0.5)


class ServiceStack:
    """See the module docstring. `cluster_cfg`: the rehearsed config's `cluster` section (its shape)."""

    def __init__(self, root: str | Path, cluster_cfg: Any, tool_service: tuple[Any, list[str]] | None = None):
        """`tool_service`: (the rehearsed config's `sandbox` section, the overrides `rstar2 tools deploy` gets
        over the production profile) when its sandbox is the tool service: the cluster then gets a tool node
        declaring `sandbox.service.node_resource`, and the service is deployed on it as infra/ says."""
        self.root = Path(root)
        self.cluster_cfg = cluster_cfg
        self.tool_service = tool_service
        self.tools_port = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = self.root / "logs"
        self.home = self.root / "home"
        self.cluster: Any = None
        self.pg_port = self.s3_port = self.mlflow_port = self.prefect_port = 0

    # ------------------------------------------------------------------ addresses
    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    def db_url(self, db: str, driver: str = "postgresql") -> str:
        return f"{driver}://rstar2@127.0.0.1:{self.pg_port}/{db}"

    def s3_env(self) -> dict[str, str]:
        """What every process that reads the stores gets: the credentials and the region."""
        return {**CREDENTIALS, "AWS_DEFAULT_REGION": REGION}

    def endpoint_overrides(self) -> list[str]:
        """The config's endpoints pointed at this stack (the overlay's allowed endpoint keys)."""
        out = [f'tracking.tracking_uri="{self.tracking_uri}"', f'storage.s3_endpoint_url="{self.s3_endpoint}"',
               f'storage.s3_region="{REGION}"', f'cluster.ray_address="{self.cluster.address}"']
        if self.tools_port:
            out.append(f'sandbox.service.url="{self.tools_url}"')
        return out

    @property
    def tools_url(self) -> str:
        return f"http://127.0.0.1:{self.tools_port}{self.tool_service[0].service.route_prefix}"

    # ------------------------------------------------------------------ start / stop
    def _start(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
               base_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**(os.environ if base_env is None else base_env), **(env or {})},
                                 start_new_session=True, **kw)
        self.procs[name] = p
        return p

    def start(self) -> Self:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)                 # the postgres user reads its folder below
        self.home.mkdir(exist_ok=True)
        try:
            self._postgres()
            self._moto()
            self._mlflow()
            self._prefect()
            self._cluster()
            self._tools()
            self._worker()
        except BaseException:
            self.stop()
            raise
        return self

    def _postgres(self) -> None:
        data, sock = self.root / "pg" / "data", self.root / "pg" / "sock"
        sock.mkdir(parents=True, exist_ok=True)
        user: dict = {}
        if os.geteuid() == 0:                 # PostgreSQL refuses to run as root: its own system user
            user = {"user": "postgres", "group": "postgres"}
            shutil.chown(self.root / "pg", "postgres", "postgres")
            shutil.chown(sock, "postgres", "postgres")
        self.pg_port = free_port()
        subprocess.run([pg_bin("initdb"), "-D", str(data), "-U", "rstar2", "-A", "trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, **user)
        p = self._start("postgres", [pg_bin("postgres"), "-D", str(data), "-p", str(self.pg_port), "-k", str(sock),
                                     "-h", "127.0.0.1", "-c", "fsync=off"], **user)
        t0 = time.monotonic()
        while subprocess.run([pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.pg_port)],
                             check=False, capture_output=True).returncode != 0:
            if p.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"PostgreSQL did not start: {(self.logs / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.3)
        for db in ("prefect", "mlflow"):
            subprocess.run([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.pg_port), "-U", "rstar2", db],
                           check=True, capture_output=True)

    def _moto(self) -> None:
        import boto3

        self.s3_port = free_port()
        p = self._start("moto", [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(self.s3_port)])
        wait_http(self.s3_endpoint, "moto S3 server", 60, p, self.logs / "moto.log")
        s3 = boto3.client("s3", endpoint_url=self.s3_endpoint, region_name=REGION, aws_access_key_id="rehearsal",
                          aws_secret_access_key="rehearsal")
        for b in BUCKETS:
            s3.create_bucket(Bucket=b)

    def _mlflow(self) -> None:
        self.mlflow_port = free_port()
        p = self._start("mlflow", [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port),
                                   "--workers", "1", "--backend-store-uri", self.db_url("mlflow", "postgresql+psycopg2"),
                                   "--artifacts-destination", "s3://rstar2-mlflow/artifacts", "--serve-artifacts"],
                        env={**self.s3_env(), "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
                             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        wait_http(f"{self.tracking_uri}/health", "MLflow tracking server", 300, p, self.logs / "mlflow.log")

    def _prefect(self) -> None:
        self.prefect_port = free_port()
        env = {"PREFECT_API_DATABASE_CONNECTION_URL": self.db_url("prefect", "postgresql+asyncpg"),
               "PREFECT_HOME": str(self.root / "prefect-server"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_UI_API_URL": self.prefect_api}
        p = self._start("prefect-server", [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                           str(self.prefect_port)], env=env)
        wait_http(f"{self.prefect_api}/health", "Prefect server", 300, p, self.logs / "prefect-server.log")

    def _cluster(self) -> None:
        from rstar2_cli.tools import tool_node
        from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster

        tools = tool_node(self.tool_service[0].service) if self.tool_service is not None else {}
        self.cluster = LocalCluster.for_config(self.cluster_cfg, self.root / "ray",
                                               env={**self.s3_env(), "RSTAR2_HOME": str(self.home)}, **tools).start()

    def _tools(self) -> None:
        """The tool service deployed on the tool node as infra/k8s/up.sh does (`rstar2 tools deploy`, a driver
        process of its own that exits once every replica runs; Serve keeps the application)."""
        if self.tool_service is None:
            return
        self.tools_port = free_port()
        from rstar2_cli.tools import tools_command

        cmd = tools_command("deploy", "qwen3-14b-mi300x", self.tool_service[1], self.cluster.address,
                            "--http-host", "127.0.0.1", "--http-port", str(self.tools_port), "--timeout-s", "300")
        p = self._start("tools-deploy", cmd, env={"RAY_AUTH_MODE": "disabled"}, base_env=self.clean_env(), cwd=str(ROOT))
        if p.wait(timeout=400) != 0:
            raise RuntimeError(f"`rstar2 tools deploy` failed (exit {p.returncode}); its log: "
                               f"{self.logs / 'tools-deploy.log'}")
        wait_http(self.tools_url + "/health", "the tool service", 60)

    def tools_status(self) -> dict:
        """`rstar2 tools status --json` on this stack's cluster (a driver process of its own, as an operator
        runs it): the service's state, replicas by state and live replica actors."""
        from rstar2_cli.tools import last_json, tools_command

        cmd = tools_command("status", "qwen3-14b-mi300x", self.tool_service[1], self.cluster.address, "--json")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False, cwd=str(ROOT),
                           env={**self.clean_env(), "RAY_AUTH_MODE": "disabled"})
        return last_json(p, "`rstar2 tools status`")

    def local_values(self) -> dict[str, str]:
        """The production endpoints and paths of infra/ and their local stand-ins (nothing else differs)."""
        return {"PREFECT_API_URL": self.prefect_api, "MLFLOW_TRACKING_URI": self.tracking_uri,
                "RAY_ADDRESS": self.cluster.address, "RSTAR2_HOME": str(self.home), "AWS_DEFAULT_REGION": REGION,
                "RSTAR2_REPO": str(ROOT)}

    def _worker(self) -> None:
        """A worker started as raycluster.yaml's `prefect-worker` container (its `--base-job-template`, the
        image's infra file, is this checkout's with the local values): it creates the pool on its first poll
        unless `deploy` did already."""
        local = self.local_values()
        tmpl = json.loads((INFRA / "prefect" / "base-job-template.json").read_text())
        props = tmpl["variables"]["properties"]
        props["env"]["default"].update({k: local[k] for k in props["env"]["default"] if k in local})
        if props.get("working_dir", {}).get("default") == IMAGE_WORKDIR:
            props["working_dir"]["default"] = str(ROOT)                 # the image's code is this checkout here
        cmd = (props.get("command", {}).get("default") or "").split()
        if cmd[:1] == ["python"]:
            props["command"]["default"] = " ".join([sys.executable, *cmd[1:]])   # the image's python is this venv's
        self.template_path.write_text(json.dumps(tmpl))
        head = yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())
        containers = head["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        spec = next(c for c in containers if c["name"] == "prefect-worker")
        wenv = {e["name"]: local.get(e["name"], e["value"]) for e in spec.get("env", [])}
        cmd = [_bin(spec["command"][0]), *spec["command"][1:]]
        if "--base-job-template" in cmd:
            cmd[cmd.index("--base-job-template") + 1] = str(self.template_path)
        self._start("prefect-worker", cmd, env={**wenv, **self.s3_env()}, base_env=self.clean_env(), cwd=str(ROOT))

    @property
    def template_path(self) -> Path:
        """infra's base job template with the local values (`_worker` writes it)."""
        return self.root / "base-job-template.json"

    def deploy(self) -> list[str]:
        """The pool's template and prefect.yaml's deployments, as infra/README.md step 3 says: `rstar2 deploy`'s
        `bring_up` (rstar2_cli/bringup.py) with this stack's API and template."""
        from rstar2_cli.bringup import bring_up

        report = bring_up(self.prefect_api, self.template_path, ROOT, pool=POOL, env=self.clean_env(),
                          log=lambda m: None)
        return list(report.deployments)

    def clean_env(self) -> dict[str, str]:
        """This process's environment without what only our scripts set (a production process has none)."""
        return {k: v for k, v in os.environ.items() if k not in ("RSTAR2_REPO", "PREFECT_API_URL", "RAY_ADDRESS")}

    def stop(self) -> None:
        """Flow runs the worker started, then the worker, the servers, the cluster, PostgreSQL: by PID."""
        import psutil

        for name in ("prefect-worker", "prefect-server", "mlflow", "moto", "postgres"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            sig = signal.SIGINT if name == "postgres" else signal.SIGTERM      # postgres: fast shutdown
            for proc in [*kids, p]:
                try:
                    proc.send_signal(sig)
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for k in kids:
                try:
                    k.kill()
                except psutil.NoSuchProcess:
                    pass
            if name == "prefect-worker" and self.cluster is not None:
                self.cluster.stop()
                self.cluster = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
