"""A small byte-level BPE tokenizer with the ChatML special tokens, trained in memory (no downloads)."""

from __future__ import annotations

import pytest

from rstar2_core.chat.prompt import CALL_EXAMPLE, system_prompt, user_message
from rstar2_core.chat.tokens import SPECIAL_TOKENS


def _corpus() -> list[str]:
    lines = [system_prompt(True), system_prompt(False), CALL_EXAMPLE]
    for i in range(300):
        lines.append(user_message(f"What is {i} + {i * 7} modulo {i % 13 + 2}?"))
        lines.append(f"<reason>Let me compute {i} * {i + 3} with the tool.\n<tool_call>\n"
                     f'{{"name": "python_code_with_standard_io", "arguments": {{"code": "print({i} * {i + 3})", '
                     f'"input": ""}}}}\n</tool_call>')
        lines.append(f">>> print({i} >> 1)\n{i >> 1}")  # shell transcripts: `>>` and `>>>` become tokens
        lines.append(f"<tool_response>\n{i * (i + 3)}\n[execution time: 0.0{i % 10}1 s]\n</tool_response>")
        lines.append(f"So the result is {i * (i + 3)}.</reason>\n<answer>The answer is \\boxed{{{i * (i + 3)}}}."
                     "</answer>")
    return lines


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=600, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


@pytest.fixture(scope="session")
def chat(tokenizer):
    from rstar2_core.chat import ChatFormat

    return ChatFormat(tokenizer)
