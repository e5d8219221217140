"""Chat/tool format of rStar2-Agent: prompts as token ids, tool-call parsing, tool results, answers.

    from rstar2_core.chat import ChatFormat, parse_tool_calls, render_tool_result, extract_answer

Names are imported lazily (PEP 562) so that a grader worker that only needs `chat.answer` does not
import the sandbox and config modules. See docs/chat-and-grading.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rstar2_core.lazy_exports import lazy_exports

_WHERE = {
    "count_answer_blocks": "answer", "count_assistant_turns": "answer", "extract_answer": "answer",
    "format_penalty": "answer", "last_boxed": "answer", "answer_blocks": "answer",
    "ChatFormat": "format",
    "TOOL_SCHEMA": "prompt", "USER_INSTRUCTION": "prompt", "system_prompt": "prompt", "user_message": "prompt",
    "ToolCall": "tool_calls", "ToolCallError": "tool_calls", "parse_tool_calls": "tool_calls",
    "middle_truncate": "tool_result", "render_tool_result": "tool_result",
}
__all__ = ["TOOL_SCHEMA", "USER_INSTRUCTION", "ChatFormat", "ToolCall", "ToolCallError", "answer_blocks",
           "count_answer_blocks", "count_assistant_turns", "extract_answer", "format_penalty", "last_boxed",
           "middle_truncate", "parse_tool_calls", "render_tool_result", "system_prompt", "user_message"]

if TYPE_CHECKING:
    from rstar2_core.chat.answer import (
        answer_blocks,
        count_answer_blocks,
        count_assistant_turns,
        extract_answer,
        format_penalty,
        last_boxed,
    )
    from rstar2_core.chat.format import ChatFormat
    from rstar2_core.chat.prompt import TOOL_SCHEMA, USER_INSTRUCTION, system_prompt, user_message
    from rstar2_core.chat.tool_calls import ToolCall, ToolCallError, parse_tool_calls
    from rstar2_core.chat.tool_result import middle_truncate, render_tool_result


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
