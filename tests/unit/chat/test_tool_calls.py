"""parse_tool_calls: every malformed call becomes a ToolCallError whose message teaches the format."""

from __future__ import annotations

import json

import pytest

from rstar2_core.chat import ToolCall, ToolCallError, parse_tool_calls
from rstar2_core.chat.tokens import TOOL_NAME


def call(args, name=TOOL_NAME, sep="\n") -> str:
    return f"<tool_call>{sep}{json.dumps({'name': name, 'arguments': args})}{sep}</tool_call>"


def one(text: str):
    out = parse_tool_calls(text)
    assert len(out) == 1, out
    return out[0]


def test_valid_call():
    assert one("Let me check.\n" + call({"code": "print(2**10)", "input": "5\n"})) == \
        ToolCall(TOOL_NAME, "print(2**10)", "5\n")


def test_stdin_alias_and_missing_input():
    assert one(call({"code": "x=input()", "stdin": "7"})) == ToolCall(TOOL_NAME, "x=input()", "7")
    assert one(call({"code": "print(1)"})) == ToolCall(TOOL_NAME, "print(1)", "")


def test_arguments_as_json_string_are_decoded():
    text = f"<tool_call>\n{json.dumps({'name': TOOL_NAME, 'arguments': json.dumps({'code': 'print(3)'})})}\n</tool_call>"
    assert one(text) == ToolCall(TOOL_NAME, "print(3)", "")


@pytest.mark.parametrize("sep", ["", " ", "\n\n", "\t \r\n"])
def test_whitespace_variants(sep):
    assert one(call({"code": "1+1", "input": ""}, sep=sep)) == ToolCall(TOOL_NAME, "1+1", "")


def test_no_calls():
    assert parse_tool_calls("<reason>just thinking</reason><answer>\\boxed{1}</answer>") == []


def test_code_containing_closing_tag_inside_json_string():
    code = 'print("</tool_call>")\ns = "<tool_call>"\nprint(s)'
    assert one(call({"code": code, "input": "</tool_call>"})) == ToolCall(TOOL_NAME, code, "</tool_call>")


def test_several_calls_in_one_turn_keep_order():
    text = (call({"code": "print(1)"}) + "\nand then\n" + "<tool_call>{oops}</tool_call>\n"
            + call({"code": "print(2)"}, name="search") + call({"code": "print(3)"}))
    out = parse_tool_calls(text)
    assert [type(o).__name__ for o in out] == ["ToolCall", "ToolCallError", "ToolCallError", "ToolCall"]
    assert out[0].code == "print(1)" and out[3].code == "print(3)"
    assert out[1].kind == "invalid_json" and out[2].kind == "unknown_tool"


@pytest.mark.parametrize("body, why", [
    ('{"name": "python_code_with_standard_io", "arguments": {"code": "print(1)"}', "Expecting"),
    ("{'name': 'python_code_with_standard_io'}", "double quotes"),
    ("python\nprint(1)", "does not start with a JSON object"),
    ('{"name": "python_code_with_standard_io", "arguments": {"code": "1"}} trailing', "after the JSON"),
    ('["python_code_with_standard_io", "print(1)"]', "does not start with a JSON object"),
    ('{"arguments": {"code": "1"}}', 'no "name"'),
])
def test_invalid_json(body, why):
    err = one(f"<tool_call>\n{body}\n</tool_call>")
    assert isinstance(err, ToolCallError) and err.kind == "invalid_json"
    assert why in err.message
    assert TOOL_NAME in err.message and "<tool_call>" in err.message  # the message shows the right format


def test_unknown_tool_is_named():
    err = one(call({"code": "1"}, name="execute_python_code_with_standard_io"))
    assert err.kind == "unknown_tool"
    assert '"execute_python_code_with_standard_io"' in err.message and f"only tool is {TOOL_NAME}" in err.message


@pytest.mark.parametrize("obj, why", [
    ({"name": TOOL_NAME, "arguments": {"input": ""}}, 'missing argument "code"'),
    ({"name": TOOL_NAME, "arguments": {"code": 123}}, '"code" must be a string'),
    ({"name": TOOL_NAME, "arguments": {"code": ["print(1)"]}}, '"code" must be a string'),
    ({"name": TOOL_NAME, "arguments": {"code": "1", "input": 5}}, '"input" must be a string'),
    ({"name": TOOL_NAME, "arguments": {"code": "1", "timeout": 5}}, "unknown argument(s) ['timeout']"),
    ({"name": TOOL_NAME, "arguments": {"code": "1", "input": "", "stdin": ""}}, "not both"),
    ({"name": TOOL_NAME}, '"arguments" must be a JSON object'),
    ({"name": TOOL_NAME, "arguments": "print(1)"}, "string that is not a JSON object"),
    ({"name": TOOL_NAME, "arguments": {"code": "1"}, "id": 3}, "unexpected field(s) ['id']"),
])
def test_bad_arguments(obj, why):
    err = one(f"<tool_call>\n{json.dumps(obj)}\n</tool_call>")
    assert isinstance(err, ToolCallError) and err.kind == "bad_arguments"
    assert why in err.message


def test_unclosed_at_end_of_turn():
    err = one("<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"code": "print(1)"}}))
    assert err.kind == "unclosed" and "</tool_call>" in err.message


def test_unclosed_followed_by_a_good_call():
    out = parse_tool_calls("<tool_call>\n{\"name\": \"python_code_with_standard_io\", \n"
                           + call({"code": "print(2)"}))
    assert [o.kind if isinstance(o, ToolCallError) else o.code for o in out] == ["unclosed", "print(2)"]


def test_valid_json_then_next_call_without_closing_tag():
    out = parse_tool_calls(f"<tool_call>\n{json.dumps({'name': TOOL_NAME, 'arguments': {'code': '1'}})}\n"
                           + call({"code": "2"}))
    assert [o.kind if isinstance(o, ToolCallError) else o.code for o in out] == ["unclosed", "2"]


def test_error_kind_is_checked():
    with pytest.raises(ValueError, match="kind"):
        ToolCallError("timeout", "x")
