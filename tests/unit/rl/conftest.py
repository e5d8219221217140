"""A toy policy for RL stage tests: a tiny Qwen2 model SFT-ed (a few seconds) to call the Python tool with
`print(1)` or `print(2)` (and sometimes a misspelt `pritn(1)` first), then answer with what it printed.
On problems whose gold answer is 1 its rollouts are ~half right, so GRPO groups have signal and an RL
step has something to learn (prefer `print(1)`)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rstar2_core import storage
from rstar2_core.chat import ChatFormat, render_tool_result
from rstar2_core.chat.tokens import REASON_CLOSE, TOOL_NAME
from rstar2_core.config import TinyModelConfig
from rstar2_core.models.io import save_checkpoint
from rstar2_core.models.tiny import build_tiny_model
from rstar2_core.models.tokenizer import bootstrap_tokenizer, train_tokenizer
from rstar2_core.sandbox.types import ExecutionResult, Status


def _call(code):
    return "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}) + "\n</tool_call>"


def _ok(out):
    return render_tool_result(ExecutionResult("d", Status.OK, out + "\n", "", 0, 0.01))


def _err():
    return render_tool_result(ExecutionResult("d", Status.ERROR, "", "NameError: name 'pritn' is not defined", 1, 0.01))


def toy_demos(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        v = rng.choice(["1", "2"])
        turns = []
        if rng.random() < 0.3:
            turns.append((f"\nRun it.\n{REASON_CLOSE}\n{_call('pritn(' + v + ')')}", [_err()]))
            turns.append((f"<reason>\nFix it.\n{REASON_CLOSE}\n{_call('print(' + v + ')')}", [_ok(v)]))
        else:
            turns.append((f"\nRun it.\n{REASON_CLOSE}\n{_call('print(' + v + ')')}", [_ok(v)]))
        turns.append((f"<reason>\nGot {v}.\n{REASON_CLOSE}\n<answer>\nThe answer is \\boxed{{{v}}}.\n</answer>", None))
        out.append((f"Toy problem {i}: what does the program print?", turns))
    return out


@pytest.fixture(scope="session")
def toy_policy(tmp_path_factory):
    """(checkpoint_url, data_url, final SFT loss) of the SFT-ed toy policy and a 12-problem RL set (gold 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only add contention at these sizes
    try:
        return build_toy_policy(tmp_path_factory.mktemp("toy_policy"))
    finally:
        torch.set_num_threads(n)


def build_toy_policy(root):
    demos = toy_demos(64)
    boot = bootstrap_tokenizer()
    bchat = ChatFormat(boot)
    texts = [boot.decode(bchat.render_trajectory(p, t)[0]) for p, t in demos]
    tok = train_tokenizer(texts, 1024)
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                            vocab_size=1024, max_position_embeddings=1024)
    model = build_tiny_model(shape, tok, seed=0)
    chat = ChatFormat(tok)
    rows = [chat.render_trajectory(p, t) for p, t in demos]
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for step in range(60):
        idx = torch.randint(0, len(rows), (8,), generator=gen).tolist()
        L = max(len(rows[i][0]) for i in idx)
        ids = torch.full((8, L), tok.pad_token_id)
        labels = torch.full((8, L), -100)
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
    data = (root / "rl.jsonl").as_uri()
    storage.write_text_atomic(data, "\n".join(
        json.dumps({"id": f"t{i}", "problem": f"Toy problem {100 + i}: what does the program print?", "answer": "1"})
        for i in range(12)))
    return ckpt, data, float(loss.detach())
