"""Special tokens and tags of the ChatML/Qwen tool format (RECIPE.md), shared by tokenizers and parsers."""

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

REASON_OPEN, REASON_CLOSE = "<reason>", "</reason>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_OPEN, TOOLS_CLOSE = "<tools>", "</tools>"

# Tokens a from-scratch tokenizer must keep whole (ChatML markers). Tags stay ordinary text so that
# pretrained tokenizers (SmolLM2, Qwen3) and ours parse the same strings.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

TOOL_NAME = "python_code_with_standard_io"
