"""A toy tool-use task and policy, small enough to SFT and RL on 2 shared CPU cores in minutes.

Task: "Toy problem i: what does the program print?", gold answer 1. Demonstrations call the Python tool
with `print(1)` or `print(2)` (half each; 30% first make a misspelt `pritn(...)` call that fails, then
fix it), then answer with what the tool printed. After SFT the policy is right about half the time
when it follows the format, so GRPO groups have signal; RL should learn to print 1, and RoC should
prefer positives without the failing first call.

A test fixture of the RL stage tests (`toy_policy` in tests/conftest.py): it builds in seconds, where the
`tiny` profile's synthetic task (what bench/learning.py measures) needs minutes of SFT.

    ckpt, data, loss = build_toy_policy(Path("/tmp/toy"), sft_steps=60)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from rstar2_core import storage
from rstar2_core.chat import ChatFormat, render_tool_result
from rstar2_core.chat.tokens import REASON_CLOSE, TOOL_NAME
from rstar2_core.config import TinyModelConfig
from rstar2_core.models.io import save_checkpoint
from rstar2_core.models.tiny import build_tiny_model
from rstar2_core.models.tokenizer import bootstrap_tokenizer, train_tokenizer
from rstar2_core.sandbox.types import ExecutionResult, Status

# two heads of 32: the head size vLLM's CPU attention takes (tests/vllm/ serve this policy)
TOY_SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
                            vocab_size=1024, max_position_embeddings=1024)


def _call(code: str) -> str:
    return ("<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": ""}})
            + "\n</tool_call>")


def _ok(out: str) -> str:
    return render_tool_result(ExecutionResult("d", Status.OK, out + "\n", "", 0, 0.01))


def _err() -> str:
    return render_tool_result(ExecutionResult("d", Status.ERROR, "", "NameError: name 'pritn' is not defined",
                                              1, 0.01))


def toy_problem(i: int) -> str:
    return f"Toy problem {i}: what does the program print?"


def toy_demos(n: int, seed: int = 0) -> list[tuple[str, list[tuple[str, list[str] | None]]]]:
    """`n` (problem, turns) demonstrations in the `ChatFormat.render_trajectory` form."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        v = rng.choice(["1", "2"])
        turns: list[tuple[str, list[str] | None]] = []
        if rng.random() < 0.3:
            turns.append((f"\nRun it.\n{REASON_CLOSE}\n{_call('pritn(' + v + ')')}", [_err()]))
            turns.append((f"<reason>\nFix it.\n{REASON_CLOSE}\n{_call('print(' + v + ')')}", [_ok(v)]))
        else:
            turns.append((f"\nRun it.\n{REASON_CLOSE}\n{_call('print(' + v + ')')}", [_ok(v)]))
        turns.append((f"<reason>\nGot {v}.\n{REASON_CLOSE}\n<answer>\nThe answer is \\boxed{{{v}}}.\n</answer>", None))
        out.append((toy_problem(i), turns))
    return out


def write_toy_problems(url: str, ids: range) -> str:
    """JSONL `{id, problem, answer: "1"}` rows for problems `ids` (RL set or held-out eval set)."""
    storage.write_text_atomic(url, "\n".join(json.dumps({"id": f"t{i}", "problem": toy_problem(i), "answer": "1"})
                                             for i in ids))
    return url


def build_toy_policy(root: Path, sft_steps: int = 60, batch: int = 8, lr: float = 5e-3, seed: int = 1
                     ) -> tuple[str, str, float]:
    """SFT a toy policy under `root`; returns (checkpoint URL, 12-problem RL set URL, last SFT loss).
    How often the policy answers right after so little SFT depends on the seed (with two heads: seed 0
    ~0.01 at the RL tests' settings, seed 1 ~0.2): the default is a seed whose sampled groups have both
    outcomes, which the RL tests need (they check it: groups kept, updates taken)."""
    demos = toy_demos(64, seed)
    boot = bootstrap_tokenizer()
    bchat = ChatFormat(boot)
    tok = train_tokenizer([boot.decode(bchat.render_trajectory(p, t)[0]) for p, t in demos], TOY_SHAPE.vocab_size)
    model = build_tiny_model(TOY_SHAPE, tok, seed=seed)
    chat = ChatFormat(tok)
    rows = [chat.render_trajectory(p, t) for p, t in demos]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(sft_steps):
        idx = torch.randint(0, len(rows), (batch,), generator=gen).tolist()
        L = max(len(rows[i][0]) for i in idx)
        ids = torch.full((batch, L), tok.pad_token_id)
        labels = torch.full((batch, L), -100)
        for b, i in enumerate(idx):
            r, m = rows[i]
            ids[b, :len(r)] = torch.tensor(r)
            labels[b, :len(r)] = torch.tensor([x if k else -100 for x, k in zip(r, m)])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ckpt = save_checkpoint(model, tok, (root / "sft").as_uri())
    data = write_toy_problems((root / "rl.jsonl").as_uri(), range(100, 112))
    return ckpt, data, float(loss.detach())
