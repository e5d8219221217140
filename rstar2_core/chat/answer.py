"""Final-answer extraction and the counts GRPO-RoC's format penalty needs.

    extract_answer("<reason>...</reason><answer>So \\\\boxed{\\\\frac{1}{2}}.</answer>") -> "\\\\frac{1}{2}"

`extract_answer` (the last `\\boxed{...}` inside the last closed answer block, else anywhere),
`count_answer_blocks`, `count_assistant_turns` and `format_penalty` (RECIPE.md's
`p_format = 1 if no answer block else min(1, (answer_blocks - 1) / turns)`).
Invariant: a correct single-turn answer has p_format = 0 for any turn count: `n_turns` counts
assistant turns, at least 1 for any response (`n_turns < 1` is a caller bug and raises).
See docs/chat-and-grading.md, "Answers and the format penalty".
"""

from __future__ import annotations

import re

from rstar2_core.chat.tokens import ANSWER_CLOSE, ANSWER_OPEN, IM_START

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """Content of the `{...}` group opening at text[start] == '{', or None if it never closes."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{}`/`\\fbox{}` in `text` (stripped), or None."""
    found = None
    for m in _BOX_RE.finditer(text):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
        elif i > m.end() and i < len(text):
            # `\boxed 7`: a single brace-less argument up to the next space or `$`.
            content = re.match(r"[^\s$]*", text[i:]).group(0).rstrip(".,") or None
        else:
            content = None
        if content is not None:
            found = content.strip()
    return found


def answer_blocks(text: str) -> list[str]:
    """Contents of the closed `<answer>...</answer>` pairs, left to right."""
    blocks, pos = [], 0
    while True:
        start = text.find(ANSWER_OPEN, pos)
        if start == -1:
            return blocks
        end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if end == -1:
            return blocks
        blocks.append(text[start + len(ANSWER_OPEN):end])
        pos = end + len(ANSWER_CLOSE)


def count_answer_blocks(text: str) -> int:
    return len(answer_blocks(text))


def extract_answer(text: str) -> str | None:
    """The final answer: last box in the last answer block if there is one, else the last box anywhere."""
    blocks = answer_blocks(text)
    return last_boxed(blocks[-1] if blocks else text)


def count_assistant_turns(response_text: str) -> int:
    """Assistant turns in a response (text after the prompt) rendered with `ChatFormat`."""
    return 1 + response_text.count(f"{IM_START}assistant")


def format_penalty(n_answer_blocks: int, n_turns: int) -> float:
    """RoC format penalty in [0, 1]: 1 without an answer block, 0 for exactly one block."""
    if n_turns < 1 or n_answer_blocks < 0:
        raise ValueError(f"n_turns={n_turns} must be >= 1 (assistant turns, the first included) and "
                         f"n_answer_blocks={n_answer_blocks} >= 0")
    if n_answer_blocks == 0:
        return 1.0
    return min(1.0, (n_answer_blocks - 1) / n_turns)
