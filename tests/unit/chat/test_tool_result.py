"""render_tool_result: what the model reads back, per status and per parse error, middle-truncated."""

from __future__ import annotations

import pytest

from rstar2_core.chat import ToolCallError, middle_truncate, parse_tool_calls, render_tool_result
from rstar2_core.sandbox.types import ExecutionResult, Status


def res(status=Status.OK, stdout="", stderr="", exit_code=0, duration_s=0.0123) -> ExecutionResult:
    return ExecutionResult(id="1", status=status, stdout=stdout, stderr=stderr, exit_code=exit_code,
                           duration_s=duration_s)


def test_success_shows_stdout_stderr_and_time():
    text = render_tool_result(res(stdout="1024\n", stderr="DeprecationWarning: x\n"))
    assert text == "1024\n[stderr]\nDeprecationWarning: x\n[execution time: 0.012 s]"


def test_success_without_output_says_so():
    assert "no output" in render_tool_result(res()) and "print()" in render_tool_result(res())


@pytest.mark.parametrize("status, exit_code, expect", [
    (Status.TIMEOUT, None, "Timeout: the program was stopped after 4.0 s"),
    (Status.MEMORY, 1, "Memory limit exceeded"),
    (Status.OUTPUT_LIMIT, None, "Output limit exceeded"),
    (Status.KILLED, -9, "Killed: the program was terminated by a signal (exit code -9)"),
    (Status.INTERNAL, None, "Internal error: the tool service failed, not your code"),
    (Status.INVALID_REQUEST, None, "Invalid request"),
])
def test_failure_reason_per_status(status, exit_code, expect):
    text = render_tool_result(res(status, stdout="partial\n", exit_code=exit_code, duration_s=4.0))
    assert text.startswith(expect)
    assert "partial" in text and text.endswith("[execution time: 4.000 s]")


def test_error_shows_stderr_with_exit_code():
    tb = 'Traceback (most recent call last):\n  File "<code>", line 1\nZeroDivisionError: division by zero\n'
    text = render_tool_result(res(Status.ERROR, stderr=tb, exit_code=1))
    assert text.startswith("Error: the program failed (exit code 1).")
    assert "ZeroDivisionError: division by zero" in text


def test_every_status_has_a_rendering():
    for status in Status:
        assert render_tool_result(res(status, exit_code=None))


@pytest.mark.parametrize("turn", [
    "<tool_call>{bad}</tool_call>",
    '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "python_code_with_standard_io", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "python_code_with_standard_io"',
])
def test_parse_errors_render_their_message(turn):
    (err,) = parse_tool_calls(turn)
    assert isinstance(err, ToolCallError)
    text = render_tool_result(err)
    assert text == err.message and f"({err.kind})" in text


def test_middle_truncation_keeps_head_and_tail_and_counts_the_cut():
    out = "".join(f"line {i}\n" for i in range(500))
    text = render_tool_result(res(stdout=out), head_chars=128, tail_chars=128, max_chars=1024)
    full = render_tool_result(res(stdout=out), max_chars=10**9)
    cut = len(full) - 256
    assert text == full[:128] + f"\n...[{cut} characters truncated]...\n" + full[-128:]
    assert text.endswith("[execution time: 0.012 s]")


def test_middle_truncate_edges():
    assert middle_truncate("x" * 1024) == "x" * 1024
    assert middle_truncate("ab" * 10, head_chars=3, tail_chars=0, max_chars=5) == \
        "aba\n...[17 characters truncated]...\n"
    assert middle_truncate("abcdef", head_chars=4, tail_chars=4, max_chars=2) == "abcdef"
    with pytest.raises(ValueError):
        middle_truncate("x", head_chars=-1)
    with pytest.raises(TypeError):
        render_tool_result("stdout text")


def test_timing_off_drops_the_wall_clock_line_only():
    ok, slow = res(stdout="1024\n"), res(stdout="1024\n", duration_s=3.5)
    assert render_tool_result(ok, timing=False) == render_tool_result(slow, timing=False) == "1024"
    failed = res(status=Status.ERROR, stdout="", stderr="ZeroDivisionError\n", exit_code=1)
    text = render_tool_result(failed, timing=False)
    assert text.startswith("Error: the program failed (exit code 1).") and text.endswith("ZeroDivisionError")
    assert "execution time" not in text
    assert render_tool_result(res(stdout=""), timing=False) == "[no output: use print() to show values]"
