"""A byte-level BPE tokenizer trained on our own corpus, with a ChatML chat template carrying the tool format.

`train_tokenizer(texts, vocab_size)` trains a `tokenizers` byte-level BPE with the special tokens of
chat/tokens.py kept whole and wraps it as a `PreTrainedTokenizerFast`; `bootstrap_tokenizer()` is the
merge-free byte-level tokenizer that renders the training corpus before the real one exists.

Invariants: the chat template renders conversations exactly as `ChatFormat` does
(`apply_chat_template(..., add_generation_prompt=True) == ChatFormat(tok).prompt_text(problem)`), and
pre-tokenization is exactly Qwen2's, since `AutoTokenizer` rebuilds any `qwen2` checkpoint's tokenizer
that way. See docs/models-and-sft.md, "The tiny model and its tokenizer".
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rstar2_core.chat.tokens import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    REASON_OPEN,
    SPECIAL_TOKENS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def _template(system_prompt: str, user_instruction: str) -> str:
    sp, ui = json.dumps(system_prompt), json.dumps("\n\n" + user_instruction)
    return (
        "{%- set ns = namespace(assistant_seen=false, in_tools=false) -%}"
        "{%- if messages[0]['role'] != 'system' -%}"
        "{{ '" + IM_START + "system\\n' + " + sp + " + '" + IM_END + "\\n' }}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'tool' -%}"
        "{%- if not ns.in_tools -%}{{ '" + IM_START + "user\\n' }}{%- else -%}{{ '\\n' }}{%- endif -%}"
        "{{ '" + TOOL_RESPONSE_OPEN + "\\n' + m['content'] + '\\n" + TOOL_RESPONSE_CLOSE + "' }}"
        "{%- set ns.in_tools = true -%}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
        "{{ '" + IM_END + "\\n' }}{%- set ns.in_tools = false -%}{%- endif -%}"
        "{%- elif m['role'] == 'system' -%}"
        "{{ '" + IM_START + "system\\n' + m['content'] + '" + IM_END + "\\n' }}"
        "{%- elif m['role'] == 'user' -%}"
        "{%- set c = m['content'] -%}"
        "{%- if not c.endswith(" + ui + ") -%}{%- set c = c + " + ui + " -%}{%- endif -%}"
        "{{ '" + IM_START + "user\\n' + c + '" + IM_END + "\\n' }}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{%- set c = m['content'] or '' -%}"
        "{%- if not ns.assistant_seen and not c.startswith('" + REASON_OPEN + "') -%}"
        "{%- set c = '" + REASON_OPEN + "' + c -%}{%- endif -%}"
        "{%- set ns.assistant_seen = true -%}"
        "{{ '" + IM_START + "assistant\\n' + c }}"
        "{%- for tc in m.get('tool_calls') or [] -%}"
        "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
        "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
        "{{ '" + TOOL_CALL_OPEN + "\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + args + '}\\n"
        + TOOL_CALL_CLOSE + "' }}"
        "{%- endfor -%}"
        "{%- if not (loop.last and m.get('tool_calls')) -%}{{ '" + IM_END + "' }}{%- endif -%}"
        "{%- if not loop.last -%}{{ '\\n' }}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{ '" + IM_START + "assistant\\n' }}{%- if not ns.assistant_seen -%}{{ '" + REASON_OPEN + "' }}{%- endif -%}"
        "{%- endif -%}"
    )


def chat_template() -> str:
    """The Jinja chat template (embeds the fixed system prompt and answer instruction)."""
    from rstar2_core.chat.prompt import USER_INSTRUCTION, system_prompt

    return _template(system_prompt(True), USER_INSTRUCTION)


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds the pipeline with it whenever
# AutoTokenizer loads a Qwen2 checkpoint, so training with anything else would not survive a reload).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _pre_tokenizer():
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated",
                                                         invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """HF wrapper: eos `<|im_end|>`, pad `<|endoftext|>`, ChatML chat template."""
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False)
    hf.chat_template = chat_template()
    hf.model_max_length = 1 << 20
    return hf


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE of `vocab_size` tokens (256 byte tokens, the ChatML specials, learned merges)."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is below the {_MIN_VOCAB} byte + special tokens; "
                         f"set model.tiny.vocab_size >= {_MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def bootstrap_tokenizer() -> PreTrainedTokenizerFast:
    """Merge-free byte-level tokenizer with the ChatML specials (renders corpus text through ChatFormat)."""
    return train_tokenizer([""], _MIN_VOCAB)
