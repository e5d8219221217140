"""The published formats of non-reasoning SFT data, read into the recipe's chat format.

`normalize_row` turns one OpenAI-style `messages` or ShareGPT `conversations` row (JSONL or parquet)
into `{"messages": [[role, text], ...]}` (roles system, user, assistant) as the model sees it: the row's
tool schemas inside `<tools>` in the system turn, each call as a `<tool_call>` JSON block after its
turn's text, consecutive tool results as one user turn of `<tool_response>` blocks. A row in the
recipe's own form (`problem` + `turns`) is left to sft/data.py.

Invariant: every other row is rejected with a reason (`rejected/<reason>` in the SFT set's counts),
never half-read. See docs/models-and-sft.md, "SFT data".
"""

from __future__ import annotations

import json
from typing import Any

from rstar2_core.chat.prompt import tool_call_text, tools_section
from rstar2_core.chat.tokens import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN
from rstar2_core.data.sources import Reject as Rejected  # one bad row; `reason` is the counter's name

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "call", "observation": "tool", "tool": "tool", "function_response": "tool"}
"""ShareGPT `from` values and what they are (`call`: a turn whose value is one call's JSON)."""


def row_format(row: Any) -> str:
    """`openai` (a `messages` list), `sharegpt` (a `conversations` list), `rstar2` (`problem` + `turns`)."""
    if not isinstance(row, dict):
        raise Rejected("not_an_object")
    if isinstance(row.get("messages"), list):
        return "openai"
    if isinstance(row.get("conversations"), list):
        return "sharegpt"
    if "problem" in row or "turns" in row:
        return "rstar2"
    raise Rejected("unknown_row_format")


def _json_value(x: Any, reason: str) -> Any:
    if isinstance(x, str):
        try:
            return json.loads(x)
        except json.JSONDecodeError:
            raise Rejected(reason) from None
    return x


def _schemas(tools: Any) -> list[dict]:
    tools = _json_value(tools, "bad_tools") if tools is not None else []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Rejected("bad_tools")
    return tools


def _call(name: Any, arguments: Any) -> str:
    args = _json_value(arguments if arguments is not None else {}, "bad_tool_call_arguments")
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        raise Rejected("bad_tool_call")
    return tool_call_text(name, args)


def _text(x: Any, allow_none: bool = False) -> str:
    if x is None and allow_none:
        return ""
    if isinstance(x, list):          # OpenAI content parts: text parts only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in x):
            raise Rejected("non_text_content")
        return "".join(p["text"] for p in x)
    if not isinstance(x, str):
        raise Rejected("bad_content")
    return x


def _turns(row: dict, fmt: str) -> tuple[list[tuple[str, str]], list[dict]]:
    """(kind, text) per turn, kinds system/user/assistant/call/tool, and the row's tool schemas."""
    out: list[tuple[str, str]] = []
    if fmt == "openai":
        for m in row["messages"]:
            if not isinstance(m, dict):
                raise Rejected("bad_message")
            role = m.get("role")
            if role not in ("system", "user", "assistant", "tool"):
                raise Rejected("unknown_role")
            calls = m.get("tool_calls") or []
            body = _text(m.get("content"), allow_none=role == "assistant" and bool(calls))
            if calls and role != "assistant":
                raise Rejected("tool_calls_outside_assistant")
            if not isinstance(calls, list):
                raise Rejected("bad_tool_call")
            rendered = []
            for c in calls:
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict):
                    raise Rejected("bad_tool_call")
                rendered.append(_call(f.get("name"), f.get("arguments")))
            if rendered:
                body = "\n".join(([body.rstrip()] if body.strip() else []) + rendered)
                out.append(("assistant_calls", body))
            else:
                out.append((role, body))
        return out, _schemas(row.get("tools"))
    for m in row["conversations"]:
        if not isinstance(m, dict):
            raise Rejected("bad_message")
        kind = SHAREGPT_ROLES.get(m.get("from"))
        if kind is None:
            raise Rejected("unknown_role")
        value = _text(m.get("value"))
        if kind == "call":
            c = _json_value(value, "bad_tool_call")
            if not isinstance(c, dict):
                raise Rejected("bad_tool_call")
            value = _call(c.get("name"), c.get("arguments"))
            if out and out[-1][0] in ("assistant", "assistant_calls"):    # the text that led to the call
                prev = out.pop()[1]
                value = "\n".join(([prev.rstrip()] if prev.strip() else []) + [value])
            kind = "assistant_calls"
        out.append((kind, value))
    return out, _schemas(row.get("tools"))


def normalize_row(row: Any) -> dict:
    """`{"messages": [[role, text], ...]}` of an OpenAI or ShareGPT row (module docstring); raises
    `Rejected` with the reason otherwise."""
    fmt = row_format(row)
    if fmt == "rstar2":
        raise Rejected("not_a_chat_row")
    turns, schemas = _turns(row, fmt)
    if not turns:
        raise Rejected("empty_conversation")
    system = _text(row["system"]) if fmt == "sharegpt" and row.get("system") else ""   # LLaMA-Factory's column
    if turns[0][0] == "system":
        system = turns.pop(0)[1]
    if any(k == "system" for k, _ in turns):
        raise Rejected("system_turn_not_first")
    if schemas:
        system = (system.rstrip() + "\n\n" if system.strip() else "") + tools_section(schemas)
    msgs: list[list[str]] = [["system", system]] if system else []
    pending: list[str] = []
    for k, (kind, text) in enumerate(turns):
        if kind == "tool":
            if not (msgs and msgs[-1][0] == "assistant" and (pending or turns[k - 1][0] == "assistant_calls")):
                raise Rejected("tool_result_without_call")
            pending.append(text)
            continue
        if pending:
            msgs.append(["user", "\n".join(f"{TOOL_RESPONSE_OPEN}\n{t}\n{TOOL_RESPONSE_CLOSE}" for t in pending)])
            pending = []
        role = "assistant" if kind == "assistant_calls" else kind
        if role == "assistant" and not text.strip():
            raise Rejected("empty_assistant_turn")
        msgs.append([role, text])
    if pending or not msgs or msgs[-1][0] != "assistant":
        raise Rejected("last_turn_not_assistant")
    if not any(r == "user" for r, _ in msgs):
        raise Rejected("no_user_turn")
    return {"messages": msgs}


def validate_messages(row: Any) -> str | None:
    """None for a normalized row (`{"messages": [[role, text], ...]}` ending with an assistant turn)."""
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        return "missing_messages"
    for m in msgs:
        if not (isinstance(m, (list, tuple)) and len(m) == 2 and m[0] in ("system", "user", "assistant")
                and isinstance(m[1], str)):
            return "bad_message"
    return None if msgs[-1][0] == "assistant" else "last_turn_not_assistant"
