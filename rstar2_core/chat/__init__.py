"""Chat/tool format of rStar2-Agent: prompts as token ids, tool-call parsing, tool results, answers.

    from rstar2_core.chat import ChatFormat, parse_tool_calls, render_tool_result, extract_answer

See docs/chat-and-grading.md.
"""

from rstar2_core.chat.answer import (
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

__all__ = [
                                     "TOOL_SCHEMA",
                                     "USER_INSTRUCTION",
                                     "ChatFormat",
                                     "ToolCall",
                                     "ToolCallError",
                                     "count_answer_blocks",
                                     "count_assistant_turns",
                                     "extract_answer",
                                     "format_penalty",
                                     "last_boxed",
                                     "middle_truncate",
                                     "parse_tool_calls",
                                     "render_tool_result",
                                     "system_prompt",
                                     "user_message",
]
