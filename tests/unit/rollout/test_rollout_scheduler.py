"""Scheduler: KV-aware admission never over-admits (property test), refills as trajectories finish,
keeps a trajectory on one engine across turns; results come back in problem order and do not depend
on the scheduler (per-trajectory seeds)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_fakes import ScriptedSandbox, call_text, tiny_model

from rstar2_core.chat.tokens import ANSWER_CLOSE, TOOL_CALL_CLOSE
from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.scheduler import KVAdmission, rollout_groups, rollout_metrics, run_rollout_groups
from rstar2_core.rollout.types import GenerationOutput, RolloutLimits


@settings(max_examples=200, deadline=None)
@given(caps=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
       mins=st.lists(st.integers(0, 800), min_size=6, max_size=6),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 2000)), max_size=80))
def test_kv_admission_never_over_admits(caps, mins, ops):
    adm = KVAdmission(caps, mins[: len(caps)])
    running: list[tuple[int, int]] = []
    for admit, tokens in ops:
        if admit or not running:
            if all(adm.cost(k, tokens) > caps[k] for k in range(len(caps))):
                with pytest.raises(ValueError, match="no engine holds"):
                    adm.try_admit(tokens)
                continue
            k = adm.try_admit(tokens)
            if k is None:       # refused only when no engine has room for it
                assert all(adm.free(j) < adm.cost(j, tokens) for j in range(len(caps)))
            else:
                running.append((k, tokens))
        else:
            k, tokens = running.pop(tokens % len(running))
            adm.release(k, tokens)
        for j in range(len(caps)):
            held = sum(adm.cost(j, t) for e, t in running if e == j)
            assert adm.reserved[j] == held <= caps[j]


@dataclass
class ToolLoopEngine:
    """Writes `turns` tool calls (code naming the turn seed, so every trajectory's text is unique), then
    answers. Tracks concurrent requests and which sequences it has served."""

    name: str
    capacity: int
    turns: int = 2
    delay_s: float = 0.01
    tokenizer: object = None
    active: int = 0
    peak: int = 0
    served: list[tuple[int, ...]] = field(default_factory=list)
    foreign_turns: int = 0

    async def generate(self, prompt_ids, params):
        turn = self.tokenizer.decode(prompt_ids).count("<tool_response>")
        if turn and not any(tuple(prompt_ids[: len(s)]) == s for s in self.served):
            self.foreign_turns += 1      # a later turn whose earlier turns ran on another engine
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(self.delay_s)
        self.active -= 1
        text = call_text(f"print({params.seed})") if turn < self.turns else "<answer>\\boxed{1}</answer>"
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        self.served.append(tuple(prompt_ids) + ids)
        return GenerationOutput(ids, (-1.0,) * len(ids), "stop", TOOL_CALL_CLOSE if turn < self.turns else ANSWER_CLOSE)

    def kv_capacity_tokens(self):
        return self.capacity

    def update_weights(self, w):
        pass

    async def close(self):
        pass


def test_kv_aware_respects_capacity_keeps_engines_and_orders_results(chat, tokenizer):
    problems = [f"What is {i} + {i}?" for i in range(5)]
    limits = RolloutLimits(max_turns=4, max_response_tokens=600)
    per_traj = max(len(chat.prompt_ids(p)) for p in problems) + 600
    engines = [ToolLoopEngine("a", capacity=3 * per_traj, tokenizer=tokenizer),
               ToolLoopEngine("b", capacity=2 * per_traj + 10, tokenizer=tokenizer)]
    groups = asyncio.run(rollout_groups(engines, ScriptedSandbox(), chat, problems, n=4, limits=limits, seed=11))
    assert [len(g) for g in groups] == [4] * 5
    assert all(t.finish == "answer" and t.n_tool_calls == 2 for g in groups for t in g)
    for i, g in enumerate(groups):   # problem order, and each trajectory on its own seed
        assert all(f"What is {i} + {i}?" in tokenizer.decode(list(t.prompt_ids)) for t in g)
        assert len({t.response_text for t in g}) == 4
    assert engines[0].peak <= 3 and engines[1].peak <= 2
    assert engines[0].peak + engines[1].peak == 5             # both engines were filled to capacity
    assert engines[0].foreign_turns == engines[1].foreign_turns == 0
    m = rollout_metrics(groups)
    assert m["rollout/trajectories"] == 20 and m["rollout/tool_calls_per_trajectory"] == 2
    assert m["rollout/finish_answer_share"] == 1.0

    static = [ToolLoopEngine("a", capacity=per_traj, tokenizer=tokenizer),
              ToolLoopEngine("b", capacity=per_traj, tokenizer=tokenizer)]
    asyncio.run(rollout_groups(static, ScriptedSandbox(), chat, problems, n=4, limits=limits, seed=11,
                               scheduler="static"))
    assert static[0].peak == static[1].peak == 10              # everything launched at once, 10 per engine
    seen = [{i for i in range(5) for ids in e.served if f"What is {i} + {i}?" in tokenizer.decode(list(ids))}
            for e in static]
    assert seen == [{0, 1, 2}, {2, 3, 4}]                      # contiguous chunks: a group stays together


def test_bad_scheduler_settings_name_the_fix(chat, tokenizer):
    eng = ToolLoopEngine("a", capacity=100, tokenizer=tokenizer)
    limits = RolloutLimits(max_turns=2, max_response_tokens=500)
    with pytest.raises(ValueError, match="no engine holds"):
        asyncio.run(rollout_groups(eng, ScriptedSandbox(), chat, ["1+1?"], n=1, limits=limits))
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'"):
        asyncio.run(rollout_groups(eng, ScriptedSandbox(), chat, ["1+1?"], n=1, limits=limits, scheduler="fifo"))


def test_hf_engines_give_the_same_groups_under_both_schedulers(chat, tokenizer, model):
    """Per-trajectory seeds make a trajectory independent of engine, batch and scheduler."""
    problems = ["What is 2 + 2?", "What is 5 * 7?"]
    limits = RolloutLimits(max_turns=2, max_response_tokens=12, temperature=1.0)

    def groups(scheduler):
        engines = [HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=1100),     # same weights (seed 0)
                   HFEngine(tiny_model(len(tokenizer), seed=0), tokenizer, max_batch_size=1, max_seq_len=1100)]
        try:
            return run_rollout_groups(engines, ScriptedSandbox(), chat, problems, 3, limits, seed=5,
                                      scheduler=scheduler)
        finally:
            for e in engines:
                asyncio.run(e.close())

    kv, st_ = groups("kv_aware"), groups("static")
    assert [[t.response_ids for t in g] for g in kv] == [[t.response_ids for t in g] for g in st_]
    assert len({t.response_ids for g in kv for t in g}) > 1
    assert all(len(t.response_ids) <= 12 and re.search(r"\S", t.response_text) for g in kv for t in g)
