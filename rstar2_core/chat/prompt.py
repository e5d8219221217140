"""The fixed texts of the rStar2-Agent prompt: system prompt, tool schema, user-turn instruction.

RECIPE.md: the reasoning goes in `<reason> </reason>`, the final answer in `<answer> </answer>` with
the result in `\\boxed{}`; the system prompt lists the tool's JSON schema inside `<tools> </tools>`.
The wording is ours (the paper does not print its prompt); `input` is optional in the schema (empty
stdin), and the parser (`tool_calls.py`) accepts `stdin` as an alias.
Invariant: these texts are part of the model's training distribution: changing a character here
changes what an SFT'd checkpoint expects, so they are constants, not config.
See docs/chat-and-grading.md, "The conversation".
"""

from __future__ import annotations

import json

from rstar2_core.chat.tokens import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    REASON_CLOSE,
    REASON_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_NAME,
    TOOLS_CLOSE,
    TOOLS_OPEN,
)

TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": ("Run a Python 3 program and return what it printed (stdout and stderr) and how long it "
                        "took. Each call is a fresh program: nothing is kept between calls. If the last "
                        "statement is an expression, its value is printed."),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The complete Python program to run."},
                "input": {"type": "string", "description": "Text fed to the program's standard input "
                                                           "(empty string if it reads none)."},
            },
            "required": ["code"],
        },
    },
}

TOOL_ARGUMENTS = ("code", "input")
"""Argument names of the tool; `stdin` is an accepted alias of `input`."""

CALL_EXAMPLE = (f'{TOOL_CALL_OPEN}\n{{"name": "{TOOL_NAME}", "arguments": '
                f'{{"code": "print(1 + 1)", "input": ""}}}}\n{TOOL_CALL_CLOSE}')
"""One well-formed call, quoted in the system prompt and in parse-error messages."""

_BASE = (
    "You are a helpful assistant that solves problems by careful step-by-step reasoning. "
    f"Write your reasoning inside {REASON_OPEN} {REASON_CLOSE} and then your final answer inside "
    f"{ANSWER_OPEN} {ANSWER_CLOSE}; the final result goes inside \\boxed{{}} within the answer, "
    f"for example {ANSWER_OPEN}The answer is \\boxed{{42}}.{ANSWER_CLOSE}"
)

_TOOLS = (
    "\n\n# Tools\n\n"
    "While reasoning you may call a Python tool to compute, check or explore; you will see its output "
    "and can continue reasoning.\n\n"
    f"The tool's function signature is given within {TOOLS_OPEN}{TOOLS_CLOSE} XML tags:\n"
    f"{TOOLS_OPEN}\n<<schema>>\n{TOOLS_CLOSE}\n\n"
    f"For each call, write a JSON object with the function name and arguments within "
    f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
    f"{TOOL_CALL_OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{TOOL_CALL_CLOSE}\n"
    f"For example:\n{CALL_EXAMPLE}"
)

USER_INSTRUCTION = (f"Put your final answer inside {ANSWER_OPEN} {ANSWER_CLOSE}, "
                    "with the final result in \\boxed{}.")
"""Appended to every user turn that carries a problem (RECIPE.md: each user turn repeats it)."""


def system_prompt(with_tools: bool = True) -> str:
    """The system message text (no ChatML markers)."""
    if not with_tools:
        return _BASE
    return _BASE + _TOOLS.replace("<<schema>>", json.dumps(TOOL_SCHEMA, ensure_ascii=False))


def user_message(problem: str) -> str:
    """The user message text for one problem: the problem, a blank line, then the answer instruction."""
    return f"{problem.strip()}\n\n{USER_INSTRUCTION}"


def tools_section(schemas: list[dict]) -> str:
    """The system-prompt section that lists any tools (one JSON schema per line inside `<tools>`) and asks
    for calls in the recipe's `<tool_call>` JSON form: how the SFT set's function-calling rows present
    their own tools (rstar2_core/sft/formats.py), the same layout as the Python tool's section above."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request.\n\n"
            f"The function signatures are given within {TOOLS_OPEN}{TOOLS_CLOSE} XML tags:\n"
            f"{TOOLS_OPEN}\n{listed}\n{TOOLS_CLOSE}\n\n"
            f"For each call, write a JSON object with the function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
            f"{TOOL_CALL_OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{TOOL_CALL_CLOSE}")


def tool_call_text(name: str, arguments: dict) -> str:
    """One call as the model writes it: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
