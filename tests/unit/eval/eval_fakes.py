"""Scripted stand-ins for the policy sampler and the math grader (imported by the eval tests)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from rstar2_core.rollout.types import ToolCallRecord, Trajectory


def traj(text: str, n_tokens: int = 10, calls: tuple = (), truncated: bool = False, gen: int | None = None):
    gen = n_tokens if gen is None else gen
    return Trajectory(prompt_ids=(1,), response_ids=tuple(range(n_tokens)),
                      loss_mask=tuple([1] * gen + [0] * (n_tokens - gen)), logprobs=tuple([0.0] * n_tokens),
                      response_text=text, tool_calls=tuple(calls), n_turns=1, n_answer_blocks=1,
                      finish="max_tokens" if truncated else "answer", truncated=truncated)


class ScriptedSampler:
    """Answers each sample correctly with probability `p`, drawn from Random((seed, problem, j)); the
    gold answers come from `gold` (problem text -> answer). Wrong answers are "-1"."""

    def __init__(self, gold: dict[str, str], p: float):
        self.gold, self.p = gold, p
        self.seeds: list[int] = []

    def sample(self, problems, n, limits, seed):
        self.seeds.append(seed)
        out = []
        for pr in problems:
            group = []
            for j in range(n):
                ok = random.Random(f"{seed}|{pr}|{j}").random() < self.p
                ans = self.gold[pr] if ok else "-1"
                calls = (ToolCallRecord("python", "ok", False), ToolCallRecord("python", "error", True))
                group.append(traj(f"<reason>r</reason><answer>\\boxed{{{ans}}}</answer>", 10 + j, calls, j == 0))
            out.append(group)
        return out

    def close(self):
        pass


@dataclass(frozen=True)
class Grade:
    reward: float
    extracted: str | None
    reason: str


def exact_grader(items):
    out = []
    for text, gold in items:
        m = re.findall(r"\\boxed\{([^{}]*)\}", text)
        if not m:
            out.append(Grade(0.0, None, "no_answer"))
        else:
            out.append(Grade(float(m[-1] == gold), m[-1], "correct" if m[-1] == gold else "wrong"))
    return out


def build_tokenizer():
    """A small byte-level BPE tokenizer with the ChatML specials (any text encodes)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from rstar2_core.chat.tokens import SPECIAL_TOKENS

    corpus = [f"<reason>Compute {i} with the tool.</reason><answer>\\boxed{{{i}}}</answer>" for i in range(100)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


class KnownAccuracyEngine:
    """An `Engine` that, per trajectory, first calls the Python tool once, then answers: correctly with
    probability p, drawn from Random(seed of its first turn) (so the rollout seed decides). It finds the
    problem (hence the gold answer) by decoding the prompt; the decision travels in the conversation (a
    comment in the tool call). `decisions` records (problem, correct)."""

    def __init__(self, tokenizer, gold: dict[str, str], p: float):
        self.tok, self.gold, self.p = tokenizer, gold, p
        self.decisions: list[tuple[str, bool]] = []

    async def generate(self, prompt_ids, params):
        from rstar2_core.chat.tokens import TOOL_NAME
        from rstar2_core.rollout.types import GenerationOutput

        text = self.tok.decode(prompt_ids)
        problem = next(p for p in self.gold if p in text)
        if "<tool_response>" not in text:
            ok = random.Random(params.seed).random() < self.p
            self.decisions.append((problem, ok))
            code = f"print(6 * 7)  # {'right' if ok else 'wrong'}"
            call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": ""}})
            out, stop = f"Let me check.\n<tool_call>\n{call}\n</tool_call>", "</tool_call>"
        else:
            ans = self.gold[problem] if "# right" in text else "-1"
            out, stop = f"Done.</reason>\n<answer>\\boxed{{{ans}}}</answer>", "</answer>"
        ids = self.tok.encode(out, add_special_tokens=False)
        return GenerationOutput(tuple(ids), tuple(-0.1 for _ in ids), "stop", stop)

    def kv_capacity_tokens(self):
        return 1_000_000

    def update_weights(self, weights):
        pass

    async def close(self):
        pass


class FlakySampler(ScriptedSampler):
    """A `ScriptedSampler` whose infrastructure fails sample j of every problem for j < `failed_per_problem`:
    the engine request fails (`infra_error`, no answer), as a dead or overloaded engine leaves it."""

    def __init__(self, gold: dict[str, str], p: float, failed_per_problem: int):
        super().__init__(gold, p)
        self.failed_per_problem = failed_per_problem

    def sample(self, problems, n, limits, seed):
        groups = super().sample(problems, n, limits, seed)
        broken = Trajectory(prompt_ids=(1,), response_ids=(), loss_mask=(), logprobs=(), response_text="",
                            tool_calls=(), n_turns=0, n_answer_blocks=0, finish="infra_error", truncated=False,
                            infra_error="engine: request failed (connection reset)")
        return [[broken if j < self.failed_per_problem else t for j, t in enumerate(g)] for g in groups]
