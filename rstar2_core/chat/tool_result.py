"""Render one tool outcome as the text inside a `<tool_response>` block.

    render_tool_result(ExecutionResult(id="", status=Status.OK, stdout="1024\\n", stderr="",
                                       exit_code=0, duration_s=0.012))
    -> "1024\\n\\n[execution time: 0.012 s]"

Success: stdout, stderr under `[stderr]`, the execution time (unless `timing=False`); failure: one
line naming the reason, then what the program printed; over-long text is middle-truncated.
Invariant: the text is for the model only; RL never reads it back (the error penalty uses
`ExecutionResult.status` / `ToolCallError`, not a search for "error").
See docs/chat-and-grading.md, "Tool results".
"""

from __future__ import annotations

from rstar2_core.chat.tool_calls import ToolCallError
from rstar2_core.sandbox.types import ExecutionResult, Status

_FAILURE_HEADLINE: dict[Status, str] = {
    Status.ERROR: "Error: the program failed{exit}. Read the error below and fix the code.",
    Status.TIMEOUT: ("Timeout: the program was stopped after {secs} s because it ran too long. "
                     "Use a faster method or smaller search."),
    Status.MEMORY: "Memory limit exceeded: the program used too much memory and was stopped.",
    Status.OUTPUT_LIMIT: "Output limit exceeded: the program printed too much; print less (e.g. only the result).",
    Status.KILLED: "Killed: the program was terminated by a signal{exit}.",
    Status.INTERNAL: "Internal error: the tool service failed, not your code. You may call the tool again.",
    Status.INVALID_REQUEST: "Invalid request: the tool could not run this call.",
}


def middle_truncate(text: str, head_chars: int = 128, tail_chars: int = 128, max_chars: int = 1024) -> str:
    """`text` if it has at most `max_chars` characters, else its head and tail around a cut marker."""
    if min(head_chars, tail_chars) < 0 or max_chars < 1:
        raise ValueError(f"head_chars={head_chars}, tail_chars={tail_chars} must be >= 0 and "
                         f"max_chars={max_chars} >= 1")
    if len(text) <= max_chars or len(text) <= head_chars + tail_chars:
        return text
    cut = len(text) - head_chars - tail_chars
    tail = text[len(text) - tail_chars:] if tail_chars else ""
    return f"{text[:head_chars]}\n...[{cut} characters truncated]...\n{tail}"


def _body(result: ExecutionResult) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    return "\n".join(parts)


def _render_execution(result: ExecutionResult, timing_line: bool) -> str:
    body = _body(result)
    timing = f"[execution time: {result.duration_s:.3f} s]" if timing_line else ""
    if result.status is Status.OK:
        if not body:
            body = "[no output: use print() to show values]"
        return f"{body}\n{timing}" if timing else body
    exit_txt = f" (exit code {result.exit_code})" if result.exit_code is not None else ""
    headline = _FAILURE_HEADLINE[result.status].format(exit=exit_txt, secs=f"{result.duration_s:.1f}")
    return "\n".join(p for p in (headline, body, timing) if p)


def render_tool_result(item: ExecutionResult | ToolCallError, head_chars: int = 128, tail_chars: int = 128,
                       max_chars: int = 1024, timing: bool = True) -> str:
    """The text inside one `<tool_response>` for an executed call or a call that did not parse. `timing`:
    end an executed call's text with its execution time (`rollout.tool_response_timing`)."""
    if isinstance(item, ToolCallError):
        text = item.message
    elif isinstance(item, ExecutionResult):
        text = _render_execution(item, timing)
    else:
        raise TypeError(f"render_tool_result takes an ExecutionResult or a ToolCallError, got {type(item).__name__}")
    return middle_truncate(text, head_chars, tail_chars, max_chars)
