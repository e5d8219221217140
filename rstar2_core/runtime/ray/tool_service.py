"""The tool service: the sandbox as a Ray Serve application on CPU nodes of its own.

    deploy_tool_service(cfg.sandbox, http_port=8000)      # `rstar2 tools deploy`, once per cluster
    async with ToolServiceHandle(cfg.sandbox) as sb:       # a stage, connected to the same Ray cluster
        results = await sb.run_batch(reqs)

Each replica (`ToolService`) is one `LocalSandbox` (same confinement, limits, statuses) reached over HTTP
(FastAPI behind Serve's proxy: /run, /run_batch, /health, OpenAPI at /docs) or through Serve's handle
(`execute`, no HTTP). Invariant: a malformed request is refused with a 4xx and its reason before a sandbox
sees it; a replica that cannot confine calls refuses to start with the cause and the manifest setting
that fixes it (`ToolServiceRefused`). See docs/sandbox.md, "The tool service".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import ray
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.api import _run as _run_app

from rstar2_core.config import SandboxConfig
from rstar2_core.errors import ToolServiceRefused, ToolServiceUnavailable
from rstar2_core.sandbox.remote import LostBatch, ServiceCalls
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

log = logging.getLogger("rstar2.sandbox")
DEPLOYMENT = "ToolService"

# ------------------------------------------------------------------------------------------ wire types
api = FastAPI(title="rstar2 tool service", version="1",
              description="Runs Python in the rstar2 sandbox (docs/sandbox.md). Statuses: ok, error, timeout, "
                          "memory, output_limit, killed, internal (the service's fault), invalid_request.")


class Call(BaseModel):
    """One program to run: `code`, optional `stdin`, an `id` echoed back."""
    model_config = ConfigDict(extra="forbid", strict=True)
    code: str
    stdin: str = ""
    id: str = ""


class Batch(BaseModel):
    """Up to `sandbox.service.max_batch` calls, run concurrently; results in the same order."""
    model_config = ConfigDict(extra="forbid", strict=True)
    requests: list[Call]


class Result(BaseModel):
    """`ExecutionResult` (rstar2_core/sandbox/types.py) as JSON."""
    id: str
    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    duration_s: float
    truncated: bool = False
    cpu_s: float | None = None


class Results(BaseModel):
    results: list[Result]


# ------------------------------------------------------------------------------------------ refusal
_FIXES = {
    "apparmor": "securityContext.appArmorProfile: {type: Unconfined} (a container runtime's default AppArmor "
                "profile denies mount and pivot_root)",
    "seccomp": "securityContext.seccompProfile: {type: Unconfined} (the runtime's default seccomp profile denies "
               "unshare, mount and setns to a container without CAP_SYS_ADMIN; the sandbox installs its own filter "
               "on every call)",
    "caps": "securityContext.capabilities.add: [SYS_ADMIN] (namespaces and the calls' private mounts)",
}


def refusal_with_fix(cause: str) -> str:
    """`cause` (why the sandbox refused to start) with the manifest settings of the tool pods that fix it,
    most likely first."""
    c = cause.lower()
    order = (["apparmor", "caps", "seccomp"] if any(k in c for k in ("mount", "pivot_root", "minimal_root", "private_tmp"))
             else ["seccomp", "caps", "apparmor"])
    fixes = "; ".join(_FIXES[k] for k in order)
    return (f"the tool service cannot confine calls on this host: {cause.strip()}. In Kubernetes, give the tool "
            f"pods (infra/k8s/raycluster.yaml, worker group `tools`) {fixes}; elsewhere run the service as root on "
            "a host that allows mount, user and network namespaces. `rstar2 sandbox doctor` in the pod shows what "
            "it allows")


# ------------------------------------------------------------------------------------------ the replica
@serve.deployment(name=DEPLOYMENT)
@serve.ingress(api)
class ToolService:
    """One replica: a `LocalSandbox` started in the constructor (a refusal fails the replica with its fix)."""

    def __init__(self, cfg: dict):
        from rstar2_core.sandbox.service import LocalSandbox, SandboxError

        self.cfg = SandboxConfig.model_validate(cfg)
        sc = self.cfg.service
        workers = self.cfg.workers or max(2, int(2 * sc.cpus_per_replica))
        local = {k: v for k, v in cfg.items() if k != "service"}
        try:
            self.sb = LocalSandbox(SandboxConfig.model_validate({**local, "backend": "local", "workers": workers})).start()
        except SandboxError as e:
            raise ToolServiceRefused(refusal_with_fix(str(e))) from None
        self.replica = f"{ray.get_runtime_context().get_node_id()[:12]}/{os.getpid()}"
        self.started = time.time()

    def _check(self, calls: list[Call]) -> None:
        sc = self.cfg.service
        if len(calls) > sc.max_batch:
            raise HTTPException(413, f"{len(calls)} calls in one batch; at most sandbox.service.max_batch = "
                                     f"{sc.max_batch}: split the batch")
        for c in calls:
            n = max(len(c.code), len(c.stdin))
            if n > sc.max_code_chars:
                raise HTTPException(413, f"call {c.id!r}: code or stdin of {n} characters; at most "
                                         f"sandbox.service.max_code_chars = {sc.max_code_chars}")

    # The results go out as JSON written here (a Response skips FastAPI's second validation of what the
    # sandbox built); `response_model` still documents them in the OpenAPI page.
    @api.post("/run", response_model=Result)
    async def run(self, call: Call) -> Response:
        self._check([call])
        res = await self.sb.run(ExecutionRequest(code=call.code, stdin=call.stdin, id=call.id))
        return Response(json.dumps(res.to_json()), media_type="application/json")

    @api.post("/run_batch", response_model=Results)
    async def run_batch(self, batch: Batch) -> Response:
        self._check(batch.requests)
        res = await self.sb.run_batch([ExecutionRequest(code=c.code, stdin=c.stdin, id=c.id) for c in batch.requests])
        return Response(json.dumps({"results": [r.to_json() for r in res]}), media_type="application/json")

    @api.get("/health")
    async def health(self) -> dict:
        feats = next(iter(self.sb.features.values()), {}).get("features") or {}
        from rstar2_core.sandbox.properties import properties

        return {"replica": self.replica, "workers": self.sb.workers, "up_s": round(time.time() - self.started, 1),
                "isolation": sorted(k for k, ok in properties(feats).items() if ok), "stats": self.sb.stats()}

    async def execute(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        """The in-cluster handle's entry (no HTTP): the requests are checked by the caller (remote.py)."""
        return await self.sb.run_batch(reqs)

    async def ping(self) -> dict:
        return await self.health()

    def __del__(self) -> None:
        sb = getattr(self, "sb", None)
        if sb is not None:
            sb.close()


def tool_service_app(cfg: SandboxConfig):
    """The Serve application of `cfg.service` (replicas or autoscaling, CPUs, the tool nodes' resource)."""
    sc = cfg.service
    actor = {"num_cpus": sc.cpus_per_replica, **({"resources": {sc.node_resource: 1}} if sc.node_resource else {})}
    opts: dict = {"ray_actor_options": actor, "max_ongoing_requests": sc.max_ongoing_requests,
                  "health_check_period_s": 5, "graceful_shutdown_timeout_s": 5}
    if sc.max_replicas:
        opts["autoscaling_config"] = {"min_replicas": sc.replicas, "max_replicas": sc.max_replicas,
                                      "target_ongoing_requests": sc.target_ongoing_requests,
                                      "upscale_delay_s": 5, "downscale_delay_s": 60}
    else:
        opts["num_replicas"] = sc.replicas
    return ToolService.options(**opts).bind(cfg.model_dump(mode="json"))


def deploy_tool_service(cfg: SandboxConfig, *, http_host: str = "0.0.0.0", http_port: int = 8000,
                        timeout_s: float = 300.0) -> dict:
    """Deploy (or update in place) the tool service on the connected Ray cluster and wait until every replica
    is up. Raises `ToolServiceRefused` when replicas cannot confine calls (the cause and the fix), a
    `RuntimeError` naming Serve's message when the deployment fails otherwise or does not finish in
    `timeout_s` (e.g. no node has `node_resource`). Returns `tool_service_status`."""
    sc = cfg.service
    # one HTTP proxy, on the head (the address sandbox.service.url names: the head's Service in Kubernetes)
    serve.start(proxy_location="HeadOnly", http_options={"host": http_host, "port": http_port})
    try:
        # Serve's own run without its wait (which has no deadline): the loop below waits, and names failures
        _run_app(tool_service_app(cfg), name=sc.app_name, route_prefix=sc.route_prefix, _blocking=False)
    except Exception as e:   # noqa: BLE001
        raise RuntimeError(f"deploying the tool service failed: {type(e).__name__}: {str(e)[:1000]}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        st = tool_service_status(sc.app_name)
        if st["status"] == "RUNNING":
            return st
        if st["status"] == "DEPLOY_FAILED" or "ToolServiceRefused: " in st.get("message", ""):
            msg = st.get("message", "")
            marker = "ToolServiceRefused: "      # the exception's line in the replica's traceback
            if marker in msg:
                raise ToolServiceRefused(msg[msg.rindex(marker) + len(marker):].split("\n")[0])
            raise RuntimeError(f"the tool service failed to deploy: {msg[-1500:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tool service did not come up within {timeout_s:.0f} s (status {st['status']}: "
                               f"{st.get('message', '')[-500:]}); with sandbox.service.node_resource = "
                               f"{sc.node_resource!r}, check that the tool nodes declare it and have "
                               f"{sc.cpus_per_replica:g} free CPUs per replica")
        time.sleep(1.0)


def tool_service_status(app_name: str) -> dict:
    """Serve's view of the application: status (`NOT_DEPLOYED`, `DEPLOYING`, `RUNNING`, `DEPLOY_FAILED`,
    ...), its message, the replicas by state and the live replica actors' names (`replica_actors`: a
    replica Serve replaced after a loss has a new name)."""
    apps = serve.status().applications
    if app_name not in apps:
        return {"status": "NOT_DEPLOYED", "message": f"no Serve application {app_name!r} on this Ray cluster",
                "replicas": {}, "replica_actors": []}
    app = apps[app_name]
    dep = app.deployments.get(DEPLOYMENT)
    out = {"status": str(getattr(app.status, "value", app.status)), "message": app.message or ""}
    if dep is not None:
        out["replicas"] = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
        out["message"] = (out["message"] + "\n" + (dep.message or "")).strip()
    out["replica_actors"] = sorted(a["name"] for a in replica_actors(app_name))
    return out


def delete_tool_service(app_name: str) -> None:
    """Remove the application (its replicas stop; Serve's controller and proxy stay)."""
    serve.delete(app_name)


def replica_actors(app_name: str) -> list[dict]:
    """The application's live replica actors (`name`, `namespace`), as Ray lists them."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app_name}#{DEPLOYMENT}#")]


def kill_one_replica(app_name: str) -> str:
    """SIGKILL one replica of the application (a lost tool node, for fault tests); returns its actor name.
    Serve starts a replacement; calls it held fail on the caller's side and are sent again."""
    live = replica_actors(app_name)
    if not live:
        raise ValueError(f"kill-sandbox: the tool service {app_name!r} has no live replica to kill")
    ray.kill(ray.get_actor(live[0]["name"], namespace=live[0]["namespace"]), no_restart=True)
    return live[0]["name"]


def shutdown_tool_services() -> None:
    """Stop Serve on the connected cluster: every application, the controller and the proxy."""
    serve.shutdown()


class ToolServiceHandle(ServiceCalls):
    """The tool service through Serve's deployment handle (callers connected to its Ray cluster)."""

    transport = "handle"

    def __init__(self, cfg: SandboxConfig):
        super().__init__(cfg)
        if not ray.is_initialized():
            raise RuntimeError("the tool service's handle needs a connection to its Ray cluster (ray.init); "
                               "outside it set sandbox.service.url and connect = \"http\"")
        self._handle = None

    def where(self) -> str:
        return f"Ray Serve application {self.sc.app_name!r}"

    def _h(self):
        if self._handle is None:
            self._handle = serve.get_app_handle(self.sc.app_name)
        return self._handle

    async def _health(self) -> dict:
        st = await asyncio.to_thread(tool_service_status, self.sc.app_name)
        if st["status"] != "RUNNING":
            raise ToolServiceUnavailable(
                f"the tool service ({self.where()}) is {st['status']}: {st['message'][-300:]}. Deploy it with "
                "`rstar2 tools deploy` (docs/sandbox.md, \"The tool service\"); a retry of the stage finds it once "
                "it runs")
        return await self._h().ping.remote()

    async def _send(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError, RayServeException

        try:
            return await self._h().execute.remote(reqs)
        except (RayActorError, BackPressureError, RayServeException) as e:
            raise LostBatch(f"{type(e).__name__}: {str(e)[:200]}") from None
        except RayTaskError as e:   # the replica raised: its sandbox failed, not the programs
            raise LostBatch(f"the replica failed: {str(e)[-300:]}") from None


__all__ = ["ToolService", "ToolServiceHandle", "api", "delete_tool_service", "deploy_tool_service",
           "kill_one_replica", "refusal_with_fix", "replica_actors", "shutdown_tool_services", "tool_service_app", "tool_service_status"]
