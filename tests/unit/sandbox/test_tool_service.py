"""The tool service (`sandbox.backend = "service"`): the sandbox deployed on Ray Serve, called through the
in-cluster handle and over HTTP with the local service's answers; malformed requests refused with a 4xx
and a reason before a sandbox sees them; a replica killed mid-batch costs no call; autoscaling adds a
replica while calls queue; a service that is down is a named, retryable error in seconds; a host that
denies the sandbox's namespaces refuses the deploy with the cause and the manifest fix. Local Ray, 2 CPUs,
one deployment for the module (slow)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rstar2_core.config import SandboxConfig
from rstar2_core.errors import ToolServiceUnavailable
from rstar2_core.sandbox import ExecutionRequest, Status

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_cfg(port: int, **service) -> SandboxConfig:
    return SandboxConfig(backend="service", workers=2, timeout_s=2.0, cpu_time_s=4.0, memory_mb=256, preload=["math"],
                         service={"replicas": 2, "cpus_per_replica": 0.5, "url": f"http://127.0.0.1:{port}/sandbox",
                                  "max_code_chars": 1000, "max_batch": 8, "ready_timeout_s": 5.0,
                                  "max_ongoing_requests": 4, **service})


@pytest.fixture(scope="module")
def service():
    """The tool service deployed on a local Ray (2 replicas); removed, with Serve, at the end of the module."""
    from ray import serve
    from ray_local import local_ray_session

    from rstar2_core.runtime.ray.tool_service import deploy_tool_service

    port = _free_port()
    cfg = service_cfg(port)
    with local_ray_session("tools"):
        st = deploy_tool_service(cfg, http_host="127.0.0.1", http_port=port, timeout_s=240)
        assert st["replicas"] == {"RUNNING": 2}, st
        try:
            yield cfg
        finally:
            serve.shutdown()


CASES = [("print(6 * 7)", Status.OK, "42"), ("1/0", Status.ERROR, "ZeroDivisionError"),
         ("while True: pass", Status.TIMEOUT, ""), ("import sys; sys.stdout.write(input()[::-1])", Status.OK, "cba")]


@pytest.mark.parametrize("transport", ["handle", "http"])
def test_the_service_answers_as_the_local_sandbox_through_both_transports(service, transport):
    from rstar2_core.runtime.ray.tool_service import ToolServiceHandle
    from rstar2_core.sandbox.remote import HttpToolService

    client = ToolServiceHandle(service) if transport == "handle" else HttpToolService(service)
    reqs = [ExecutionRequest(code=c, stdin="abc" if "input" in c else "", id=str(i)) for i, (c, _, _) in enumerate(CASES)]
    reqs += [ExecutionRequest(code=None, id="bad"), ExecutionRequest(code="x" * 1001, id="long")]  # type: ignore[arg-type]

    async def go():
        async with client as c:
            return await c.run_batch(reqs * 3), c.stats()   # 18 calls: more than max_batch = 8, so 3 requests

    res, stats = asyncio.run(go())
    assert [r.id for r in res] == [r.id for r in reqs] * 3
    for g in range(3):
        for r, (_, status, out) in zip(res[6 * g:6 * g + 4], CASES):
            assert r.status is status and out in (r.stdout + r.stderr), r
    bad = [r for r in res if r.id in ("bad", "long")]
    assert len(bad) == 6 and all(r.status is Status.INVALID_REQUEST for r in bad)
    assert "max_code_chars = 1000" in bad[1].stderr
    assert stats["sandbox/service_refused_calls"] == 6 and stats["sandbox/service_requests"] == 2   # 12 valid calls
    assert stats["sandbox/service_lost_calls"] == 0


def test_malformed_http_requests_get_a_4xx_with_the_reason_and_never_reach_a_sandbox(service):
    import httpx

    url = service.service.url
    before = _replica_calls(service)
    bodies = [("/run", "not json", 422, "JSON decode error"), ("/run", '{"code": 3}', 422, "valid string"),
              ("/run", '{"code": "1", "shell": true}', 422, "Extra inputs are not permitted"),
              ("/run", '{"stdin": "x"}', 422, "Field required"),
              ("/run", json.dumps({"code": "x" * 1001}), 413, "sandbox.service.max_code_chars = 1000"),
              ("/run_batch", json.dumps({"requests": [{"code": "1"}] * 9}), 413, "sandbox.service.max_batch = 8"),
              ("/run_batch", json.dumps({"requests": "print(1)"}), 422, "valid list")]
    for path, body, code, reason in bodies:
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == code and reason in r.text, (path, body[:40], r.status_code, r.text[:300])
    after = _replica_calls(service)
    assert after == before, "a refused request reached a sandbox"
    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    assert {"/run", "/run_batch", "/health"} <= set(spec["paths"])
    one = httpx.post(url + "/run", json={"code": "print(1)", "id": "x"}, timeout=30).json()
    assert (one["id"], one["status"], one["stdout"]) == ("x", "ok", "1\n")


@pytest.mark.parametrize("transport", ["handle", "http"])
def test_a_replica_killed_mid_batch_costs_no_call(service, transport):
    """Half a batch is running on each replica when one is killed: its calls are sent again and answered by
    the other replica (or the replacement), never graded as the program's error."""
    from rstar2_core.runtime.ray.tool_service import (
        ToolServiceHandle,
        kill_one_replica,
        replica_actors,
        tool_service_status,
    )
    from rstar2_core.sandbox.remote import HttpToolService

    client = ToolServiceHandle(service) if transport == "handle" else HttpToolService(service)
    reqs = [ExecutionRequest(code=f"import time; time.sleep(1.5); print({i})", id=str(i)) for i in range(8)]
    deadline = time.monotonic() + 60     # a replica replaced by an earlier test may still be registering
    while len(replica_actors(service.service.app_name)) != 2:
        assert time.monotonic() < deadline, replica_actors(service.service.app_name)
        time.sleep(1)

    async def go():
        async with client as c:
            # eight requests of one call: at most 4 on a replica (max_ongoing_requests), so both hold 4; one dies
            base = _call_processes()
            task = asyncio.gather(*(c.run_batch([r]) for r in reqs))
            deadline = time.monotonic() + 60       # until both replicas run calls (2 workers each): then kill
            while _call_processes() < base + 4:
                assert time.monotonic() < deadline, "the replicas never ran the calls"
                await asyncio.sleep(0.05)
            killed = kill_one_replica(service.service.app_name)
            parts = await task
            return [r for part in parts for r in part], c.stats(), killed

    before = tool_service_status(service.service.app_name)["replica_actors"]
    res, stats, killed = asyncio.run(go())
    assert [r.status for r in res] == [Status.OK] * 8, [(r.status, r.stderr[:120]) for r in res]
    assert [r.stdout for r in res] == [f"{i}\n" for i in range(8)]
    assert stats["sandbox/service_retried_batches"] >= 1 and stats["sandbox/service_lost_calls"] == 0
    deadline = time.monotonic() + 120         # Serve replaces the replica
    while tool_service_status(service.service.app_name).get("replicas") != {"RUNNING": 2}:
        assert time.monotonic() < deadline, tool_service_status(service.service.app_name)
        time.sleep(1)
    after = tool_service_status(service.service.app_name)["replica_actors"]     # what `rstar2 tools status` lists
    assert killed in before and killed not in after and len(after) == 2 and len(set(after) - set(before)) == 1


def _call_processes() -> int:
    """Processes below the tool service's replicas (their templates, and the calls running in them)."""
    import psutil

    n = 0
    for p in psutil.process_iter(["cmdline"]):
        if "ServeReplica:rstar2-tools" in " ".join(p.info["cmdline"] or []):
            try:
                n += len(p.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return n


def test_autoscaling_adds_a_replica_while_calls_queue(service):
    """`sandbox.service.max_replicas` > `replicas`: Serve's autoscaler (by requests per replica, queued and
    running) adds a replica while more calls wait than `target_ongoing_requests`; every call is answered."""
    from ray import serve

    from rstar2_core.runtime.ray.tool_service import (
        ToolServiceHandle,
        deploy_tool_service,
        tool_service_status,
    )

    cfg = service.model_copy(update={"service": service.service.model_copy(update={
        "app_name": "rstar2-tools-autoscale", "route_prefix": "/autoscale", "replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 1.0})})
    st = deploy_tool_service(cfg, http_host="127.0.0.1", http_port=int(service.service.url.rsplit(":", 1)[1].split("/")[0]),
                             timeout_s=240)
    assert st["replicas"] == {"RUNNING": 1}, st
    try:
        async def load() -> tuple[list, dict]:
            results, seen = [], {}
            async with ToolServiceHandle(cfg) as c:
                deadline = time.monotonic() + 120         # Serve's metrics reach its controller every few seconds
                while time.monotonic() < deadline:
                    batch = await asyncio.gather(*(c.run_batch([ExecutionRequest(
                        code="import time; time.sleep(1.0); print('ok')", id=str(i))]) for i in range(8)))
                    results += [r for part in batch for r in part]
                    seen = await asyncio.to_thread(tool_service_status, cfg.service.app_name)
                    if seen.get("replicas", {}).get("RUNNING", 0) == 2:
                        break
            return results, seen

        results, seen = asyncio.run(load())
        assert seen.get("replicas") == {"RUNNING": 2}, seen                   # scaled up under queued calls
        assert {(r.status, r.stdout) for r in results} == {(Status.OK, "ok\n")}
    finally:
        serve.delete(cfg.service.app_name)


def test_a_service_that_is_down_is_a_named_retryable_error_in_seconds(service):
    from rstar2_core.runtime.ray.tool_service import ToolServiceHandle
    from rstar2_core.sandbox.remote import HttpToolService
    from tasks.retry import is_infrastructure_error

    down = service_cfg(_free_port(), ready_timeout_s=3.0)        # nothing listens there
    missing = service_cfg(_free_port(), app_name="not-deployed", ready_timeout_s=3.0)
    for client, needle in ((HttpToolService(down), "cannot be reached"), (ToolServiceHandle(missing), "NOT_DEPLOYED")):
        with pytest.raises(ToolServiceUnavailable, match=needle) as e:
            asyncio.run(client.__aenter__())
        assert "rstar2 tools deploy" in str(e.value)     # the fix is named; ready_timeout_s bounds the wait
        assert is_infrastructure_error(e.value)


def test_a_stage_runs_its_tool_calls_on_the_service(service, toy_policy, tmp_path):
    """The runtime of a stage with sandbox.backend = "service" (what rollout, the label check and evaluation
    open) sends its tool calls to the service: an RL stage's calls and a hard-subset selection's samples
    (evaluation's sampler) show up in the replicas' counters."""
    from rstar2_core.config import load_config
    from rstar2_core.rl.hard_subset import select_hard_subset
    from rstar2_core.rl.stage import run_rl_stage

    ckpt, data, _ = toy_policy
    sc = service.service
    over = ["rl.prompts_per_step=3", "rl.grpo.group_size=4", "rl.stages.0.steps=1", "rl.stages.0.max_response_tokens=160",
            "rl.stages.0.max_turns=3", "rl.micro_batch_size=8", "rl.temperature=0.6", "sandbox.workers=2",
            'sandbox.backend="service"', f'sandbox.service.url="{sc.url}"', "sandbox.service.ready_timeout_s=10",
            "rl.stages.2.hard_subset_k=2", "rl.stages.2.max_response_tokens=160"]
    cfg = load_config("tiny", over)
    calls0 = _replica_calls(service)
    res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "rl").as_uri())
    used = res.metrics.get("total/usage/sandbox_calls", 0)
    assert used > 0 and res.metrics.get("total/rollout/infra_failed", 0) == 0, res.metrics
    ref = select_hard_subset(cfg, 2, checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "hard").as_uri())
    assert ref.counts["infra_failed"] == 0
    assert _replica_calls(service) >= calls0 + used


def _replica_calls(cfg: SandboxConfig) -> int:
    """Calls run by the service's replicas: the handle pings each replica it reaches (both, over 16 tries)."""
    import ray
    from ray import serve

    h = serve.get_app_handle(cfg.service.app_name)
    seen: dict[str, int] = {}
    for _ in range(16):
        info = h.ping.remote().result(timeout_s=30)
        seen[info["replica"]] = info["stats"].get("sandbox/calls", 0)
    assert ray.is_initialized()
    return int(sum(seen.values()))


_DENIED = """
import errno, json, sys
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
for name in ("unshare", "mount"):              # what a runtime's default AppArmor and seccomp profiles deny
    f.add_rule(sc.ERRNO(errno.EPERM), name)
f.load()                                       # Ray's processes started below, the replicas among them, inherit it
sys.path.insert(0, "tests")
from ray_local import local_ray_session
from rstar2_core.config import SandboxConfig
from rstar2_core.errors import ToolServiceRefused
from rstar2_core.runtime.ray.tool_service import deploy_tool_service
cfg = SandboxConfig(backend="service", workers=1, preload=["math"], service={"replicas": 1, "cpus_per_replica": 0.5})
out = {"refused": None}
with local_ray_session("denied"):
    try:
        deploy_tool_service(cfg, http_host="127.0.0.1", http_port=int(sys.argv[1]), timeout_s=180)
    except ToolServiceRefused as e:
        out["refused"] = str(e)
print(json.dumps(out))
"""


def test_a_host_that_denies_the_sandboxs_namespaces_refuses_the_deploy_with_the_cause_and_the_fix():
    proc = subprocess.run([sys.executable, "-c", _DENIED, str(_free_port())], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    why = out["refused"]
    assert why is not None, "the service deployed on a host that denies unshare and mount"
    assert "unshare" in why and "allow_missing_isolation" in why, why          # the cause, from the sandbox
    for fix in ("appArmorProfile: {type: Unconfined}", "seccompProfile: {type: Unconfined}", "SYS_ADMIN",
                "infra/k8s/raycluster.yaml, worker group `tools`"):
        assert fix in why, why
