"""The tool service's HTTP client without a service: which client a stage gets, what it refuses before
sending, and a service that does not answer: a named error at start, `internal` (never a program status)
for calls it loses. The service itself: test_tool_service.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_core.config import SandboxConfig
from rstar2_core.errors import ToolServiceUnavailable
from rstar2_core.sandbox import ExecutionRequest, Status

ROOT = Path(__file__).resolve().parents[3]


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/sandbox"


def cfg(**service) -> SandboxConfig:
    return SandboxConfig(backend="service", service={"url": _closed_url(), "ready_timeout_s": 3.0, "call_retries": 1,
                                                     "max_code_chars": 100, **service})


_HTTP_CHOICE = """
import sys
from rstar2_core.config import ClusterConfig, SandboxConfig
from rstar2_core.runtime.sandboxes import service_sandbox
cfg = SandboxConfig(backend="service", service={"url": "http://127.0.0.1:9/sandbox"})
c = service_sandbox(cfg, cluster=ClusterConfig())
print(type(c).__name__, "ray" in sys.modules and sys.modules["ray"].is_initialized())
"""


def test_a_stage_without_a_ray_address_gets_the_http_client_and_starts_no_ray():
    """In a fresh process (this one may be connected to an earlier test's Ray)."""
    out = subprocess.run([sys.executable, "-c", _HTTP_CHOICE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["HttpToolService", "False"], out


def test_a_service_that_does_not_answer_is_named_at_start_and_its_lost_calls_are_internal():
    from rstar2_core.sandbox.remote import HttpToolService

    c = HttpToolService(cfg())
    with pytest.raises(ToolServiceUnavailable, match=r"cannot be reached.*rstar2 tools deploy"):
        asyncio.run(c.__aenter__())
    reqs = [ExecutionRequest(code="print(1)", id="a"), ExecutionRequest(code="x" * 101, id="long"),
            ExecutionRequest(code=7, id="bad")]                                   # type: ignore[arg-type]
    res = asyncio.run(c.run_batch(reqs))
    assert [r.status for r in res] == [Status.INTERNAL, Status.INVALID_REQUEST, Status.INVALID_REQUEST]
    assert "lost the call 2 times" in res[0].stderr and "max_code_chars = 100" in res[1].stderr
    s = c.stats()
    assert (s["sandbox/service_requests"], s["sandbox/service_retried_batches"], s["sandbox/service_lost_calls"],
            s["sandbox/service_refused_calls"]) == (2, 1, 1, 2)
    single = asyncio.run(c.run_single(ExecutionRequest(code="print(1)", id="s")))
    assert single.status is Status.INTERNAL and single.id == "s"


def test_batches_are_cut_to_the_services_limit():
    from rstar2_core.sandbox.remote import ServiceCalls
    from rstar2_core.sandbox.types import ExecutionResult

    sizes: list[int] = []

    class Recorder(ServiceCalls):
        def where(self) -> str:
            return "here"

        async def _send(self, reqs):
            sizes.append(len(reqs))
            return [ExecutionResult(r.id, Status.OK, r.code, "", 0, 0.0) for r in reqs]

    c = Recorder(cfg(max_batch=4))
    res = asyncio.run(c.run_batch([ExecutionRequest(code=str(i), id=str(i)) for i in range(10)]))
    assert sorted(sizes) == [2, 4, 4] and [r.stdout for r in res] == [str(i) for i in range(10)]
