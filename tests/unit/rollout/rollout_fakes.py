"""Helpers for the rollout tests: a small BPE tokenizer with the ChatML specials (trained in memory),
a random tiny Qwen2 model, a scripted engine that replays fixed token sequences, and a scripted
sandbox. The scripted doubles stand in for the model's *behaviour* (which tool calls it writes) and
the sandbox's verdicts, so that each test pins one property of the agent loop."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import torch

from rstar2_core.chat.tokens import SPECIAL_TOKENS, TOOL_NAME
from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status


def call_text(code: str, stdin: str = "", name: str = TOOL_NAME) -> str:
    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code, "input": stdin}})
            + "\n</tool_call>")


def _corpus() -> list[str]:
    lines = []
    for i in range(200):
        lines.append(f"Let me compute {i} * {i + 3} with the tool.\n" + call_text(f"print({i} * {i + 3})"))
        lines.append(f"<tool_response>\n{i * (i + 3)}\n[execution time: 0.01 s]\n</tool_response>")
        lines.append(f"So the result is {i}.</reason>\n<answer>The answer is \\boxed{{{i}}}.</answer>")
    return lines


def build_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=400, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def tiny_model(vocab_size: int, seed: int = 0, max_pos: int = 2048):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max_pos,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


@dataclass
class ScriptedEngine:
    """Replays one list of turns (token id lists) per trajectory; the trajectory is recognised by the
    first prompt it sends (its prompt ids). Records every request."""

    turns: dict[tuple[int, ...], list[GenerationOutput]]
    delay_s: float | dict = 0.0          # or {prompt key: delay}
    capacity: int = 10_000
    fail_on_turn: int | None = None
    requests: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    log: list[tuple[str, float]] = field(default_factory=list)

    async def generate(self, prompt_ids, params):
        self.requests.append((list(prompt_ids), params))
        key = next(k for k in self.turns if tuple(prompt_ids[: len(k)]) == k)
        i = sum(1 for p, _ in self.requests if tuple(p[: len(key)]) == key) - 1
        if self.fail_on_turn is not None and i == self.fail_on_turn:
            raise RuntimeError("engine crashed")
        await asyncio.sleep(self.delay_s[key] if isinstance(self.delay_s, dict) else self.delay_s)
        out = self.turns[key][i]
        n = min(len(out.token_ids), params.max_new_tokens)
        if n < len(out.token_ids):
            out = GenerationOutput(out.token_ids[:n], out.logprobs[:n], "length")
        self.log.append((f"gen_end:{key[-1]}:{i}", time.perf_counter()))
        return out

    def kv_capacity_tokens(self):
        return self.capacity

    def update_weights(self, weights):
        pass

    async def close(self):
        pass


def scripted_turn(tokenizer, text: str, stop_string: str | None = None, reason: str = "stop",
                  ids: list[int] | None = None) -> GenerationOutput:
    ids = ids if ids is not None else tokenizer.encode(text, add_special_tokens=False)
    return GenerationOutput(tuple(ids), tuple(-0.5 for _ in ids), reason, stop_string)


@dataclass
class ScriptedSandbox:
    """Answers each request from `verdict(code)`; records (request, time) pairs."""

    verdict: object = None
    delay_s: float = 0.0
    calls: list[tuple[ExecutionRequest, float]] = field(default_factory=list)

    async def run(self, req: ExecutionRequest) -> ExecutionResult:
        self.calls.append((req, time.perf_counter()))
        await asyncio.sleep(self.delay_s)
        if self.verdict is not None:
            return self.verdict(req)
        return ExecutionResult(id=req.id, status=Status.OK, stdout=f"ran {len(req.code)} chars\n", stderr="",
                               exit_code=0, duration_s=0.01)
