"""Scheduler: `rollout_groups` drives the admission policy on real engine calls. KV-aware admission
learns lengths and admits more than the paper's rule without the engines' live KV passing their
capacity, holds trajectories at turn boundaries when the projection passes it, keeps a trajectory on
one engine across turns; results come back in problem order and do not depend on the scheduler
(per-trajectory seeds)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import pytest
from rollout_fakes import ScriptedSandbox, call_text, tiny_model

from rstar2_core.chat.tokens import ANSWER_CLOSE, TOOL_CALL_CLOSE
from rstar2_core.rollout import scheduler
from rstar2_core.rollout.admission import Job
from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.length_model import LengthModel
from rstar2_core.rollout.scheduler import rollout_groups, rollout_metrics, run_rollout_groups
from rstar2_core.rollout.types import GenerationOutput, RolloutLimits


@dataclass
class ToolLoopEngine:
    """A paged engine double: writes `turns` tool calls (filler tokens, then code naming the turn seed,
    so every trajectory's text is unique), then answers, taking `step_s` per token. Tracks concurrent requests, requests of later
    turns, and its live KV: every unfinished trajectory's sequence, in flight (its prompt from the start
    of the request, the generated tokens from its end) or cached between turns."""

    name: str
    capacity: int
    turns: int = 2
    filler: int = 0
    spread: int = 0              # plus (seed % spread) filler tokens: lengths vary between trajectories
    step_s: float = 2e-4         # per generated token: every request advances a token a step, as in an engine
    tokenizer: object = None
    active: int = 0
    peak: int = 0
    later_active: int = 0
    later_peak: int = 0
    served: list[tuple[int, ...]] = field(default_factory=list)
    live: dict[object, int] = field(default_factory=dict)   # cached sequence or in-flight request -> tokens
    peak_kv: int = 0
    peak_live: int = 0
    first_wave: int = 0          # requests that arrived before any request had completed
    completed: int = 0
    foreign_turns: int = 0

    async def generate(self, prompt_ids, params):
        prompt = tuple(prompt_ids)
        turn = self.tokenizer.decode(prompt_ids).count("<tool_response>")
        own = [s for s in self.live if turn and isinstance(s, tuple) and prompt[: len(s)] == s]
        if turn and not own:
            self.foreign_turns += 1      # a later turn whose earlier turns ran on another engine
        for s in own:
            del self.live[s]
        text = call_text(f"print({params.seed})") if turn < self.turns else "<answer>\\boxed{1}</answer>"
        filler = self.filler + (params.seed % self.spread if self.spread else 0)
        ids = tuple([self.tokenizer.encode("a", add_special_tokens=False)[0]] * filler
                    + self.tokenizer.encode(text, add_special_tokens=False))
        request = object()
        self.first_wave += not self.completed
        self._book(request, len(prompt))                           # prefilled
        self.active += 1
        self.later_active += bool(turn)
        self.peak, self.later_peak = max(self.peak, self.active), max(self.later_peak, self.later_active)
        await asyncio.sleep(self.step_s * len(ids))
        self.active -= 1
        self.later_active -= bool(turn)
        del self.live[request]
        self.completed += 1
        self._book(prompt + ids, len(prompt) + len(ids))           # generated: its KV is there now
        self.served.append(prompt + ids)
        if turn >= self.turns:
            del self.live[prompt + ids]                          # answered: the trajectory is done
        return GenerationOutput(ids, (-1.0,) * len(ids), "stop", TOOL_CALL_CLOSE if turn < self.turns else ANSWER_CLOSE)

    def _book(self, seq: object, tokens: int) -> None:
        self.live[seq] = tokens
        self.peak_kv = max(self.peak_kv, sum(self.live.values()))
        self.peak_live = max(self.peak_live, len(self.live))

    def kv_capacity_tokens(self):
        return self.capacity

    def update_weights(self, w):
        pass

    async def close(self):
        pass


def test_kv_aware_learns_lengths_within_capacity_keeps_engines_and_orders_results(chat, tokenizer):
    """The paper's rule runs 3 and 2 trajectories at once (prompt + 1,500 tokens each); learning the
    lengths (within step 1, then from it in step 2) runs more, and live KV stays within capacity."""
    problems = [f"What is {i} + {i}?" for i in range(20)]
    limits = RolloutLimits(max_turns=4, max_response_tokens=1500)      # a trajectory writes ~220-400
    per_traj = max(len(chat.prompt_ids(p)) for p in problems) + 1500
    lengths = LengthModel(1500, min_at_risk=4)                         # 80 trajectories a step: thin data
    steps = []
    for seed in (11, 12):
        engines = [ToolLoopEngine("a", capacity=3 * per_traj, spread=60, tokenizer=tokenizer),
                   ToolLoopEngine("b", capacity=2 * per_traj + 10, spread=60, tokenizer=tokenizer)]
        groups = asyncio.run(rollout_groups(engines, ScriptedSandbox(), chat, problems, n=4, limits=limits,
                                            seed=seed, lengths=lengths))
        steps.append(engines)
        assert [len(g) for g in groups] == [4] * 20
        assert all(t.finish == "answer" and t.n_tool_calls == 2 for g in groups for t in g)
        for i, g in enumerate(groups):   # problem order, and each trajectory on its own seed
            assert all(f"What is {i} + {i}?" in tokenizer.decode(list(t.prompt_ids)) for t in g)
            assert len({t.response_text for t in g}) == 4
        for e in engines:
            assert e.foreign_turns == 0                        # a trajectory stays on its engine
            assert e.peak_kv <= e.capacity                     # live KV never passed the capacity
    assert [e.first_wave for e in steps[0]] == [3, 2]          # nothing known yet: the paper's rule
    assert steps[1][0].first_wave > 3 and steps[1][1].first_wave > 2   # step 2 starts from step 1's lengths
    assert lengths.n_observed == 160
    m = rollout_metrics(groups)
    assert m["rollout/trajectories"] == 80 and m["rollout/tool_calls_per_trajectory"] == 2
    assert m["rollout/finish_answer_share"] == 1.0

    static = [ToolLoopEngine("a", capacity=per_traj, tokenizer=tokenizer),
              ToolLoopEngine("b", capacity=per_traj, tokenizer=tokenizer)]
    asyncio.run(rollout_groups(static, ScriptedSandbox(), chat, problems[:5], n=4, limits=limits, seed=11,
                               scheduler="static"))
    assert static[0].peak == static[1].peak == 10              # everything launched at once, 10 per engine
    seen = [{i for i in range(5) for ids in e.served if f"What is {i} + {i}?" in tokenizer.decode(list(ids))}
            for e in static]
    assert seen == [{0, 1, 2}, {2, 3, 4}]                      # contiguous chunks: a group stays together


def test_trajectories_outgrowing_the_stage_lengths_are_held_at_turn_boundaries(chat, tokenizer, monkeypatch):
    """The stage's lengths say ~60 tokens, so 6 are admitted where 4 fit at the maximum length; each turn
    then writes ~250 (a mid-turn overshoot the policy cannot see coming). From the first boundary on
    the projection passes the capacity: the young are held, and later turns never run more than the 4
    that fit, oldest first."""
    problems = [f"What is {i} + {i}?" for i in range(3)]
    limits = RolloutLimits(max_turns=4, max_response_tokens=600)
    per_traj = max(len(chat.prompt_ids(p)) for p in problems) + 600
    lengths = LengthModel(600)
    for _ in range(100):
        lengths.observe(60)
    made = []
    real = scheduler.make_policy
    monkeypatch.setattr(scheduler, "make_policy", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    engine = ToolLoopEngine("a", capacity=4 * per_traj, turns=1, filler=250, tokenizer=tokenizer)
    groups = asyncio.run(rollout_groups([engine], ScriptedSandbox(), chat, problems, n=4, limits=limits, seed=3,
                                        lengths=lengths))
    assert all(t.finish == "answer" and t.n_tool_calls == 1 for g in groups for t in g)
    assert engine.first_wave == 6                              # admitted on the (wrong) short lengths
    assert made[0].stats["holds"] > 0 and engine.later_peak <= 4
    assert lengths.n_observed == 112                           # the stage's model learnt this step's lengths


def test_bad_scheduler_settings_name_the_fix(chat, tokenizer, model):
    eng = ToolLoopEngine("a", capacity=100, tokenizer=tokenizer)
    limits = RolloutLimits(max_turns=2, max_response_tokens=500)
    with pytest.raises(ValueError, match="no engine holds"):
        asyncio.run(rollout_groups(eng, ScriptedSandbox(), chat, ["1+1?"], n=1, limits=limits))
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'"):
        asyncio.run(rollout_groups(eng, ScriptedSandbox(), chat, ["1+1?"], n=1, limits=limits, scheduler="fifo"))
    with pytest.raises(ValueError, match="one LengthModel per stage"):
        asyncio.run(rollout_groups(ToolLoopEngine("a", capacity=10 ** 6, tokenizer=tokenizer), ScriptedSandbox(),
                                   chat, ["1+1?"], n=1, limits=limits, lengths=LengthModel(1000)))
    hf = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=300)
    with pytest.raises(ValueError, match="raise its max_seq_len"):
        asyncio.run(rollout_groups(hf, ScriptedSandbox(), chat, ["1+1?"], n=1, limits=limits))


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


class _SecondAfterFirstTurn:
    """A policy that admits trajectory 1 only once trajectory 0 has finished a turn (as KV-aware admission
    does when a turn end lowers an engine's projection)."""

    def __init__(self, jobs, admit_second=True):
        self.jobs, self.turns_ended, self.admitted, self.admit_second = list(jobs), 0, set(), admit_second

    def admit(self):
        out = []
        for job in self.jobs:
            ok = job.tid == 0 or (self.turns_ended and self.admit_second)
            if ok and job.tid not in self.admitted:
                self.admitted.add(job.tid)
                out.append((job, 0))
        return out

    def resumable(self):
        return []

    def begin_turn(self, tid, kv):
        return True

    def end_turn(self, tid, kv):
        self.turns_ended += 1

    def release(self, tid, kv):
        pass


def test_a_turn_end_can_admit_the_next_trajectory_before_any_finishes():
    events: list[str] = []

    class Engine:
        async def generate(self, prompt_ids, params):
            await asyncio.sleep(0.01)
            return GenerationOutput(token_ids=(1, 2), logprobs=(0.0, 0.0), finish_reason="stop")

    async def start(job, gate):
        events.append(f"start {job.tid}")
        for _ in range(3):
            await gate.generate([0] * 4, None)
        events.append(f"end {job.tid}")

    class Done:
        prompt_ids, response_ids = (0,) * 4, (1, 2)

    async def start_done(job, gate):
        await start(job, gate)
        return Done()

    jobs = [Job(0, 0, 4), Job(1, 1, 4)]
    asyncio.run(scheduler._Driver(_SecondAfterFirstTurn(jobs), [Engine()], start_done).run())
    assert events.index("start 1") < events.index("end 0"), events


def test_a_policy_that_stops_admitting_is_an_error_not_missing_groups(chat, monkeypatch):
    class Engine:
        async def generate(self, prompt_ids, params):
            return GenerationOutput(token_ids=tuple(chat.eos_token_ids[:1]), logprobs=(0.0,), finish_reason="stop")

    def policy(*a, **k):
        p = _SecondAfterFirstTurn([], admit_second=False)
        p.add = lambda jobs: p.jobs.extend(jobs)
        return p

    monkeypatch.setattr(scheduler, "make_policy", policy)
    limits = RolloutLimits(max_turns=2, max_response_tokens=16)
    with pytest.raises(RuntimeError, match="1 of 2 trajectories never admitted"):
        asyncio.run(rollout_groups([Engine()], ScriptedSandbox(), chat, ["What is 1 + 1?"], n=2, limits=limits))


def test_group_affinity_keeps_each_problem_on_one_engine_and_is_refused_with_static(chat, tokenizer):
    problems = [f"What is {i} + {i}?" for i in range(6)]
    limits = RolloutLimits(max_turns=3, max_response_tokens=600)
    per_traj = max(len(chat.prompt_ids(p)) for p in problems) + 600

    def engines_of_problem(group_affinity):
        engines = [ToolLoopEngine(n, capacity=8 * per_traj, spread=40, tokenizer=tokenizer) for n in "ab"]
        asyncio.run(rollout_groups(engines, ScriptedSandbox(), chat, problems, n=4, limits=limits, seed=3,
                                   group_affinity=group_affinity))
        return [{k for k, e in enumerate(engines) for ids in e.served
                 if f"What is {i} + {i}?" in tokenizer.decode(list(ids))} for i in range(6)]

    # a group's samples share its home engine (an engine left with nothing of its own takes queued samples
    # of another's groups at the end); per sample, groups spread over the engines
    affine = sum(len(on) - 1 for on in engines_of_problem(True))
    per_sample = sum(len(on) - 1 for on in engines_of_problem(False))
    assert affine < per_sample and affine <= 2, (affine, per_sample)
    with pytest.raises(ValueError, match="kv_aware scheduler only"):
        asyncio.run(rollout_groups([ToolLoopEngine("a", capacity=8 * per_traj, tokenizer=tokenizer)],
                                   ScriptedSandbox(), chat, problems[:1], n=2, limits=limits, scheduler="static",
                                   group_affinity=True))
