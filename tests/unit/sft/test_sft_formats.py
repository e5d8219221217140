"""The published SFT formats (OpenAI `messages`, ShareGPT `conversations`; JSONL and parquet) read into the
recipe's chat format: the row's tools inside `<tools>`, calls as `<tool_call>` JSON that the rollout's
parser reads back, results as one `<tool_response>` user turn, loss on the assistant turns only; every bad
row rejected with its reason and counted (rstar2_core/sft/formats.py, sft/data.py)."""

from __future__ import annotations

import json
import re

import pytest
from sft_test_config import small_cfg

from rstar2_core.chat import ChatFormat
from rstar2_core.models.tokenizer import bootstrap_tokenizer
from rstar2_core.sft.formats import Rejected, normalize_row


def _calls(text: str) -> list[tuple[str, dict]]:
    """The calls a turn makes, read the way the rollout's parser reads `<tool_call>` blocks (JSON inside)."""
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.DOTALL)
    return [(c["name"], c["arguments"]) for c in map(json.loads, blocks)]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}

OPENAI = {"id": "fc-1", "tools": [WEATHER], "messages": [
    {"role": "system", "content": "You are a travel assistant."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Let me look both up.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "24C, clear"},
    {"role": "assistant", "content": "Paris: 18C and sunny; Rome: 24C and clear."}]}

SHAREGPT = {"tools": json.dumps([WEATHER]), "conversations": [
    {"from": "human", "value": "Is it warm in Oslo?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
    {"from": "observation", "value": "3C, snow"},
    {"from": "gpt", "value": "No: 3C with snow."},
    {"from": "human", "value": "Thanks! Say bye in French."},
    {"from": "gpt", "value": "Au revoir !"}]}


def test_an_openai_function_calling_row_in_the_recipes_chat_format():
    msgs = normalize_row(OPENAI)["messages"]
    assert [r for r, _ in msgs] == ["system", "user", "assistant", "user", "assistant"]
    system = msgs[0][1]
    assert system.startswith("You are a travel assistant.\n\n# Tools") and json.dumps(WEATHER) in system
    assert "<tools>" in system and "<tool_call>" in system
    assert msgs[2][1].startswith("Let me look both up.\n<tool_call>\n")
    assert _calls(msgs[2][1]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert msgs[3][1] == "<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n24C, clear\n</tool_response>"


def test_a_sharegpt_row_with_a_function_call_and_two_exchanges():
    msgs = normalize_row(SHAREGPT)["messages"]
    assert [r for r, _ in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert msgs[0][1].startswith("# Tools") and msgs[3][1] == "<tool_response>\n3C, snow\n</tool_response>"
    assert _calls(msgs[2][1]) == [("get_weather", {"city": "Oslo"})]
    plain = normalize_row({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]})
    assert plain["messages"] == [["user", "Hi"], ["assistant", "Hello."]]          # no tools: no system turn


def test_the_loss_falls_on_the_assistant_turns_only():
    chat = ChatFormat(bootstrap_tokenizer())
    msgs = normalize_row(OPENAI)["messages"]
    ((ids, mask),) = chat.render_chats([[tuple(m) for m in msgs]])
    tok = chat.tokenizer
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == msgs[2][1] + "<|im_end|>" + msgs[4][1] + "<|im_end|>"
    whole = tok.decode(ids)
    assert whole == "\n".join(f"<|im_start|>{r}\n{t}<|im_end|>" for r, t in msgs)


@pytest.mark.parametrize(("row", "reason"), [
    ({"messages": []}, "empty_conversation"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"},
                   {"role": "assistant", "content": "ok"}]}, "tool_result_without_call"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "more?"}]}, "last_turn_not_assistant"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "bad_tool_call_arguments"),
    ({"tools": "[oops", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]},
     "bad_tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                   {"role": "assistant", "content": "a"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "a"}]}, "system_turn_not_first"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "no_user_turn"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}, "empty_assistant_turn"),
    ({"text": "a pretraining row"}, "unknown_row_format"),
])
def test_bad_rows_are_rejected_with_their_reason(row, reason):
    with pytest.raises(Rejected) as e:
        normalize_row(row)
    assert e.value.reason == reason


def test_an_sft_set_from_jsonl_and_parquet_sources_trains_on_every_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rstar2_core.sft.data import build_sft_dataset, read_sft_rows
    from rstar2_core.sft.packing import encode_conversations

    fc = tmp_path / "function-calling.jsonl"
    fc.write_text("\n".join([json.dumps(OPENAI), json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                             "{broken"]) + "\n")
    chat_pq = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversations": SHAREGPT["conversations"], "tools": SHAREGPT["tools"]}]),
                   chat_pq)
    cfg = small_cfg("data.synthetic.enabled=false", f'data.sft_sources=["{fc.as_uri()}", "{chat_pq.as_uri()}"]')
    ref = build_sft_dataset(cfg, (tmp_path / "sft.jsonl").as_uri())
    assert ref.n_rows == 2
    assert ref.counts == {f"source/{fc.as_uri()}": 1, f"source/{chat_pq.as_uri()}": 1, "format/openai": 1,
                          "format/sharegpt": 1, "rejected/last_turn_not_assistant": 1, "rejected/invalid_json": 1}
    rows = read_sft_rows(ref.url)
    docs, too_long = encode_conversations(rows, ChatFormat(bootstrap_tokenizer()), 4096)
    assert too_long == 0 and len(docs) == 2 and all(sum(m) > 0 for _, m in docs)
