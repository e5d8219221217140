"""Property tests: any code round-trips through a tool call; parsing and extraction never raise;
prompts and tool responses decode back to their text whatever the (adversarial) content."""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rstar2_core.chat import ToolCall, extract_answer, parse_tool_calls
from rstar2_core.chat.answer import count_answer_blocks, last_boxed
from rstar2_core.chat.tokens import TOOL_NAME

# text biased towards the characters and tags the parsers care about
_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<answer>", "</answer>", "\\boxed{", "}", "{", "\\",
                           '"', "\n", " ", "<|im_end|>", "x", "1", "é", "\\{"])
TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=5)), max_size=30).map("".join)
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(code=TEXT, stdin=TEXT, before=TEXT.filter(lambda t: "<tool_call>" not in t))
def test_any_code_round_trips(code, stdin, before):
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    assert parse_tool_calls(f"{before}<tool_call>\n{call}\n</tool_call>") == [ToolCall(TOOL_NAME, code, stdin)]


@FAST
@given(text=TEXT)
def test_parsers_never_raise(text):
    out = parse_tool_calls(text)
    n_tags = text.count("<tool_call>")
    # one entry per tag, except tags hidden inside a decoded JSON string (impossible without quotes)
    assert len(out) == n_tags if '"' not in text else len(out) <= n_tags
    ans = extract_answer(text)
    assert ans is None or isinstance(ans, str)
    # the closed pairs, each from an <answer> to the first </answer> after it (a regex's leftmost shortest match)
    assert count_answer_blocks(text) == len(re.findall(r"<answer>.*?</answer>", text, re.DOTALL))
    box = last_boxed(text)
    assert box is None or box.strip() == box


@FAST
@given(problem=TEXT, result=TEXT)
def test_prompt_and_tool_response_decode_to_their_text(chat, tokenizer, problem, result):
    assert tokenizer.decode(chat.prompt_ids(problem)) == chat.prompt_text(problem)
    ids = chat.tool_response_ids([result, result])
    assert tokenizer.decode(ids) == chat.tool_response_text([result, result])
    assert ids.count(chat.im_end_id) == 2  # content can never add a control token
