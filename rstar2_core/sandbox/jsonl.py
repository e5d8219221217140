"""JSON-lines front end of the sandbox (what `rstar2 sandbox run` uses).

Request line: {"id": "...", "code": "...", "stdin": "..."} (stdin optional). Result line:
{"id", "status", "stdout", "stderr", "exit_code", "duration_s", "truncated", "cpu_s"}. One result per request,
in input order, also for lines that are not valid JSON or lack a string `code` (status
invalid_request, stderr says why). The result echoes the request's `id` as given (null when the line
has none or is not a JSON object). Whitespace-only lines are not requests and get no result.
Requests are streamed through a bounded window, so memory stays flat on long files.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
from collections.abc import Callable
from typing import IO

from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status


def parse_request(line: str) -> ExecutionRequest | ExecutionResult:
    """The request on one line, or the invalid_request result that answers it."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        return _invalid("", f"line is not valid JSON ({e}); expected {{\"id\": ..., \"code\": ..., \"stdin\": ...}}")
    if not isinstance(obj, dict):
        return _invalid("", f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", "")
    if isinstance(rid, (int, float)) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str):
        return _invalid("", f"'id' must be a string, got {type(rid).__name__}")
    code = obj.get("code")
    if not isinstance(code, str):
        return _invalid(rid, "'code' is required and must be a string")
    stdin = obj.get("stdin") or ""
    if not isinstance(stdin, str):
        return _invalid(rid, f"'stdin' must be a string, got {type(stdin).__name__}")
    return ExecutionRequest(code=code, stdin=stdin, id=rid)


def raw_id(line: str) -> object:
    """The `id` exactly as the line gives it (None when absent or unparsable)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj.get("id") if isinstance(obj, dict) else None


def _invalid(rid: str, why: str) -> ExecutionResult:
    return ExecutionResult(id=rid, status=Status.INVALID_REQUEST, stdout="", stderr=why, exit_code=None,
                           duration_s=0.0, truncated=False)


def run_jsonl(sandbox, lines: IO[str], out: IO[str], window: int = 1024,
              progress: Callable[[ExecutionResult], None] | None = None) -> collections.Counter:
    """Answer every request line of `lines` on `out`, in order; returns the count per status."""
    pending: collections.deque[tuple[object, concurrent.futures.Future]] = collections.deque()
    counts: collections.Counter = collections.Counter()

    def emit(item: tuple[object, concurrent.futures.Future]) -> None:
        res = item[1].result()
        row = res.to_json()
        row["id"] = item[0]
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[res.status.value] += 1
        if progress is not None:
            progress(res)

    for line in lines:
        if not line.strip():
            continue
        parsed = parse_request(line)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(parsed, ExecutionResult):
            fut.set_result(parsed)
        else:
            sandbox.submit(parsed, fut.set_result)
        pending.append((raw_id(line), fut))
        while pending and (len(pending) >= window or pending[0][1].done()):
            emit(pending.popleft())
    while pending:
        emit(pending.popleft())
    out.flush()
    return counts
