"""Callers of the tool service (`sandbox.backend = "service"`, docs/sandbox.md "The tool service"): the
same async API as the local sandbox (`await run(req)`, `await run_batch(reqs)`, `run_sync`, `close`,
`stats`), over a transport. `ServiceCalls` holds what every transport shares: requests checked here
before they travel (a malformed one answers `invalid_request` and never reaches a sandbox), batches cut
to `sandbox.service.max_batch`, and a batch lost with a replica sent again; `HttpToolService` is the
HTTP transport (no Ray); the in-cluster handle is rstar2_core/runtime/ray/tool_service.py.

Invariant: a call the service lost answers status `internal` (the service's fault: the rollout excludes
the trajectory from group statistics and counts it), never a program status; sending a call again is
safe because every call is a fresh, independent execution.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Self

from rstar2_core.config import SandboxConfig
from rstar2_core.errors import ToolServiceUnavailable
from rstar2_core.sandbox.service import validate
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, internal_results, invalid_result

log = logging.getLogger("rstar2.sandbox")
RETRY_PAUSE_S = 0.5   # before sending a lost batch again (times the attempt): a replacement replica starts


class LostBatch(Exception):
    """The transport lost a batch (a dead replica, a dropped connection, an HTTP 5xx): send it again."""


class BadRequest(Exception):
    """The service refused a request as malformed (HTTP 4xx): sending it again changes nothing."""


class ServiceCalls:
    """The transport-independent half of a tool-service client; subclasses implement `_send` and `_health`."""

    transport = "?"

    def __init__(self, cfg: SandboxConfig):
        self.cfg, self.sc = cfg, cfg.service
        self.counts = {"requests": 0, "retried_batches": 0, "lost_calls": 0, "refused_calls": 0}

    # -- what a transport provides
    async def _send(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        raise NotImplementedError

    async def _health(self) -> dict:
        raise NotImplementedError

    def where(self) -> str:
        raise NotImplementedError

    # -- lifecycle
    async def health(self) -> dict:
        """The service's health answer within `ready_timeout_s`, else `ToolServiceUnavailable` naming why."""
        try:
            return await asyncio.wait_for(self._health(), self.sc.ready_timeout_s)
        except ToolServiceUnavailable:
            raise
        except Exception as e:   # noqa: BLE001 - every way of not answering is the same named error
            why = "no answer" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {str(e)[:300]}"
            raise ToolServiceUnavailable(
                f"the tool service at {self.where()} did not answer its health check within "
                f"sandbox.service.ready_timeout_s = {self.sc.ready_timeout_s:g} s ({why}). Deploy it with "
                "`rstar2 tools deploy` (docs/sandbox.md, \"The tool service\") or check `rstar2 tools status`; "
                "a retry of the stage finds it once it answers") from None

    async def __aenter__(self) -> Self:
        info = await self.health()
        log.info("tool service up at %s (%s): %s", self.where(), self.transport,
                 {k: info.get(k) for k in ("replica", "workers", "isolation")})
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the transport (the service itself keeps running: it is shared)."""

    def close(self) -> None:
        """Nothing to stop here: the service outlives its callers."""

    # -- calls
    def _refusal(self, req: object) -> str | None:
        why = validate(req)
        if why is None:
            n = max(len(req.code), len(req.stdin))  # type: ignore[attr-defined]
            if n > self.sc.max_code_chars:
                why = (f"code or stdin of {n} characters is over sandbox.service.max_code_chars = "
                       f"{self.sc.max_code_chars}")
        return why

    async def run_batch(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        results: list[ExecutionResult | None] = [None] * len(reqs)
        todo = []
        for i, r in enumerate(reqs):
            why = self._refusal(r)
            if why is None:
                todo.append(i)
            else:
                results[i] = invalid_result(r, why)
                self.counts["refused_calls"] += 1
        size = self.sc.max_batch
        parts = [todo[i:i + size] for i in range(0, len(todo), size)]
        answers = await asyncio.gather(*(self._send_again([reqs[i] for i in p]) for p in parts))
        for p, ans in zip(parts, answers):
            for i, res in zip(p, ans):
                results[i] = res
        return results  # type: ignore[return-value]

    async def _send_again(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        """`reqs` through `_send`; a lost batch is sent again up to `call_retries` times, then answers
        `internal` with the last cause."""
        why = ""
        for attempt in range(self.sc.call_retries + 1):
            if attempt:
                self.counts["retried_batches"] += 1
                await asyncio.sleep(RETRY_PAUSE_S * attempt)
            self.counts["requests"] += 1
            try:
                out = await self._send(reqs)
            except LostBatch as e:
                why = str(e)
                log.warning("tool service lost a batch of %d calls (attempt %d of %d): %s", len(reqs), attempt + 1,
                            self.sc.call_retries + 1, why)
                continue
            except BadRequest as e:
                self.counts["refused_calls"] += len(reqs)
                return [invalid_result(r, str(e)) for r in reqs]
            if len(out) != len(reqs):
                why = f"the service answered {len(out)} results for {len(reqs)} calls"
                continue
            return out
        self.counts["lost_calls"] += len(reqs)
        return internal_results(reqs, f"tool service at {self.where()} lost the call "
                                      f"{self.sc.call_retries + 1} times: {why}")

    async def run(self, req: ExecutionRequest) -> ExecutionResult:
        return (await self.run_batch([req]))[0]

    def run_sync(self, req: ExecutionRequest) -> ExecutionResult:
        async def once() -> ExecutionResult:
            try:
                return await self.run(req)
            finally:
                await self.aclose()     # the transport belongs to this call's event loop

        return asyncio.run(once())

    def stats(self) -> dict[str, float]:
        return {f"sandbox/service_{k}": float(v) for k, v in self.counts.items()}


class HttpToolService(ServiceCalls):
    """The tool service over HTTP (`sandbox.service.url`), for callers outside its Ray cluster. One
    connection pool per client; `run_batch` sends up to `max_batch` calls per POST `/run_batch`,
    `run_single` one call per POST `/run` (what an outside grader does)."""

    transport = "http"

    def __init__(self, cfg: SandboxConfig, url: str | None = None):
        super().__init__(cfg)
        self.url = (url or cfg.service.url).rstrip("/")
        if not self.url:
            raise ValueError("the HTTP client of the tool service needs sandbox.service.url")
        self._client = None

    def where(self) -> str:
        return self.url

    def _http(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.sc.request_timeout_s, connect=10.0),
                                             limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
        return self._client

    async def _post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            r = await self._http().post(self.url + path, json=body)
        except httpx.HTTPError as e:    # connection refused or dropped, a timeout
            raise LostBatch(f"{type(e).__name__}: {str(e)[:200]}") from None
        if r.status_code >= 500:
            raise LostBatch(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise BadRequest(f"the tool service refused the request (HTTP {r.status_code}): {r.text[:500]}")
        return r.json()

    async def _send(self, reqs: list[ExecutionRequest]) -> list[ExecutionResult]:
        body = {"requests": [{"code": r.code, "stdin": r.stdin, "id": r.id} for r in reqs]}
        return [ExecutionResult.from_json(d) for d in (await self._post("/run_batch", body))["results"]]

    async def run_single(self, req: ExecutionRequest) -> ExecutionResult:
        """One call per request (POST `/run`), with the same checks and retries as `run_batch`."""
        why = self._refusal(req)
        if why is not None:
            return invalid_result(req, why)
        for attempt in range(self.sc.call_retries + 1):
            if attempt:
                await asyncio.sleep(RETRY_PAUSE_S * attempt)
            try:
                return ExecutionResult.from_json(await self._post("/run", {"code": req.code, "stdin": req.stdin,
                                                                           "id": req.id}))
            except LostBatch as e:
                why = str(e)
            except BadRequest as e:
                return invalid_result(req, str(e))
        return internal_results([req], f"tool service at {self.url} lost the call: {why}")[0]

    async def _health(self) -> dict:
        import httpx

        try:
            r = await self._http().get(self.url + "/health")
        except httpx.HTTPError as e:
            raise ToolServiceUnavailable(
                f"the tool service at {self.url} (sandbox.service.url) cannot be reached: {type(e).__name__}: "
                f"{str(e)[:200]}. Deploy it with `rstar2 tools deploy`, or correct sandbox.service.url; a retry "
                "of the stage finds it once it answers") from None
        if r.status_code != 200:
            raise ToolServiceUnavailable(f"the tool service at {self.url} answered its health check with HTTP "
                                         f"{r.status_code}: {r.text[:300]}; a retry of the stage finds it once it "
                                         "is healthy (`rstar2 tools status`)")
        return r.json()

    async def aclose(self) -> None:
        if self._client is not None:
            c, self._client = self._client, None
            await c.aclose()
