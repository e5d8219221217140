"""Parse the tool calls of one assistant turn into `ToolCall`s or `ToolCallError`s.

    parse_tool_calls('...<tool_call>\\n{"name": "python_code_with_standard_io", '
                     '"arguments": {"code": "print(2**10)", "input": ""}}\\n</tool_call>')
    -> [ToolCall(name='python_code_with_standard_io', code='print(2**10)', stdin='')]

JSON-aware, not a regex split: the object after `<tool_call>` is decoded with `raw_decode`, so a tag
inside a JSON string (code that prints it) does not end the call. Invariant: a malformed call never
raises and never stops the rollout: it becomes a `ToolCallError` (`invalid_json`, `unknown_tool`,
`bad_arguments`, `unclosed`) whose `message` is the tool response the model sees.
See docs/chat-and-grading.md, "Tool calls".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from rstar2_core.chat.prompt import CALL_EXAMPLE
from rstar2_core.chat.tokens import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_NAME

ToolCallErrorKind = Literal["invalid_json", "unknown_tool", "bad_arguments", "unclosed"]
ERROR_KINDS: tuple[str, ...] = ("invalid_json", "unknown_tool", "bad_arguments", "unclosed")


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of the Python tool."""

    name: str
    code: str
    stdin: str = ""


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be executed; `message` is the tool response text the model sees."""

    kind: ToolCallErrorKind
    message: str

    def __post_init__(self) -> None:
        if self.kind not in ERROR_KINDS:
            raise ValueError(f"ToolCallError.kind={self.kind!r}; use one of {ERROR_KINDS}")


_FORMAT_HINT = f"Call the tool exactly like this:\n{CALL_EXAMPLE}"
_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def _error(kind: ToolCallErrorKind, what: str) -> ToolCallError:
    return ToolCallError(kind, f"Tool call error ({kind}): {what}\n{_FORMAT_HINT}")


def _validate(obj: object) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return _error("invalid_json", f"expected a JSON object, got a JSON {type(obj).__name__}.")
    name = obj.get("name")
    if name != TOOL_NAME:
        if name is None:
            return _error("invalid_json", 'the object has no "name" field.')
        return _error("unknown_tool", f"there is no tool named {json.dumps(name)[:80]}; "
                                      f"the only tool is {TOOL_NAME}.")
    extra_keys = sorted(set(obj) - {"name", "arguments"})
    if extra_keys:
        return _error("bad_arguments", f'unexpected field(s) {extra_keys} next to "name" and "arguments".')
    args = obj.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return _error("bad_arguments", '"arguments" is a string that is not a JSON object.')
    if not isinstance(args, dict):
        return _error("bad_arguments", '"arguments" must be a JSON object like {"code": "...", "input": ""}.')
    if "input" in args and "stdin" in args:
        return _error("bad_arguments", 'give stdin as "input" only, not both "input" and "stdin".')
    unknown = sorted(set(args) - {"code", "input", "stdin"})
    if unknown:
        return _error("bad_arguments", f"unknown argument(s) {unknown}; the tool takes \"code\" and \"input\".")
    if "code" not in args:
        return _error("bad_arguments", 'missing argument "code" (the Python program, as a string).')
    code = args["code"]
    if not isinstance(code, str):
        return _error("bad_arguments", f'"code" must be a string, got a JSON {type(code).__name__}.')
    stdin = args.get("input", args.get("stdin", ""))
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return _error("bad_arguments", f'"input" must be a string, got a JSON {type(stdin).__name__}.')
    return ToolCall(name=TOOL_NAME, code=code, stdin=stdin)


def _region_end(text: str, start: int) -> tuple[int, int]:
    """Where the call opened before `start` ends: (index of its `</tool_call>` or -1, index to resume at)."""
    close = text.find(TOOL_CALL_CLOSE, start)
    reopen = text.find(TOOL_CALL_OPEN, start)
    if close == -1 or (reopen != -1 and reopen < close):
        return -1, (reopen if reopen != -1 else len(text))
    return close, close + len(TOOL_CALL_CLOSE)


def parse_tool_calls(turn_text: str) -> list[ToolCall | ToolCallError]:
    """All tool calls of one assistant turn, in order; one entry per `<tool_call>` tag."""
    out: list[ToolCall | ToolCallError] = []
    pos = 0
    while True:
        open_at = turn_text.find(TOOL_CALL_OPEN, pos)
        if open_at == -1:
            return out
        body = open_at + len(TOOL_CALL_OPEN)
        i = body
        while i < len(turn_text) and turn_text[i] in _WS:
            i += 1
        obj, after = None, -1
        if i < len(turn_text) and turn_text[i] == "{":
            try:
                obj, after = _DECODER.raw_decode(turn_text, i)
            except json.JSONDecodeError as e:
                reason = f"{e.msg} at character {e.pos - i}"
        else:
            reason = "the text after <tool_call> does not start with a JSON object"
        if after != -1:
            j = after
            while j < len(turn_text) and turn_text[j] in _WS:
                j += 1
            if turn_text.startswith(TOOL_CALL_CLOSE, j):
                out.append(_validate(obj))
                pos = j + len(TOOL_CALL_CLOSE)
                continue
            reason = "unexpected text after the JSON object"
            scan_from = after
        else:
            scan_from = body
        close_at, pos = _region_end(turn_text, scan_from)
        if close_at == -1:
            out.append(_error("unclosed", f"the call was not closed with {TOOL_CALL_CLOSE}."))
        else:
            out.append(_error("invalid_json", f"the call is not valid JSON ({reason})."))
