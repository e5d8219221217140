"""Rollout of GRPO groups across engines: each trajectory's agent loop runs where and when the policy says.

    groups = run_rollout_groups(engines, sandbox, chat, problems, n=16, limits=limits, seed=0)
    # groups[i][j]: j-th trajectory of problems[i]

`rollout_groups` queues the n x len(problems) trajectories (problem-major) in a policy from
`admission.py` (`kv_aware`: `KVAdmission`, the default; `static`: `StaticAdmission`) and starts each
agent loop on the engine it picks; a `_TurnGate` reports every turn boundary to the policy and waits
while it holds the trajectory. Invariant: a trajectory stays on one engine for all its turns (the
engine keeps its KV between turns), and its seeds depend on (seed, problem, sample), never on engines.
See docs/rollout-scheduling.md, "Scheduler (`rollout_groups`)".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from rstar2_core.rollout.admission import (
    Job,
    KVAdmission,
    StaticAdmission,
    engine_kv,
)
from rstar2_core.rollout.agent import run_trajectory
from rstar2_core.rollout.length_model import LengthModel
from rstar2_core.rollout.types import Engine, GenerationOutput, RolloutLimits, SamplingParams, Trajectory

SCHEDULERS = ("kv_aware", "static")


def job_seed(seed: int | None, problem_index: int, sample_index: int) -> int | None:
    """Seed of trajectory j of problem i: the same (seed, i, j) gives the same trajectory on any engine."""
    return None if seed is None else (seed * 1_000_033 + problem_index) * 65_537 + sample_index


def make_policy(scheduler: str, engines: list[Engine], max_response_tokens: int, longest: int,
                lengths: LengthModel | None = None, group_affinity: bool = False) -> KVAdmission | StaticAdmission:
    """The policy of `scheduler` over `engines`, after checking that the longest trajectory (prompt +
    max_response_tokens) fits each engine's fixed-size sequence slot, when it has one."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; valid: {list(SCHEDULERS)}")
    capacities, per_sequence = engine_kv(engines)
    for per_seq in per_sequence:
        if per_seq and longest > per_seq - 1:
            raise ValueError(f"a trajectory may reach {longest} tokens (prompt + max_response_tokens) but the "
                             f"engine holds sequences of at most {per_seq - 1}; raise its max_seq_len or lower "
                             "max_response_tokens")
    if scheduler == "static":
        if group_affinity:
            raise ValueError("group_affinity applies to the kv_aware scheduler only")
        return StaticAdmission(len(engines))
    return KVAdmission(capacities, per_sequence, max_response_tokens=max_response_tokens, lengths=lengths,
                       group_affinity=group_affinity)


class _TurnGate:
    """One trajectory's view of its engine: reports each turn boundary to the policy, and before a
    later turn waits while the policy holds it. Only `generate` is used by the agent loop."""

    def __init__(self, engine: Engine, tid: int, driver: _Driver):
        self.engine, self.tid, self.driver, self.turns = engine, tid, driver, 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if self.turns:
            await self.driver.begin_turn(self.tid, len(prompt_ids))
        self.turns += 1
        out = await self.engine.generate(prompt_ids, params)
        self.driver.policy.end_turn(self.tid, len(prompt_ids) + len(out.token_ids))
        self.driver.dispatch()      # a turn end moves the projection: it may admit or resume others now
        return out


class _Driver:
    """Runs the policy's decisions: starts admitted trajectories, releases finished ones, resumes held ones."""

    def __init__(self, policy: Any, engines: list[Engine],
                 start: Callable[[Job, _TurnGate], Coroutine[Any, Any, Trajectory]]):
        self.policy, self.engines, self.start = policy, engines, start
        self.tasks: dict[asyncio.Task, Job] = {}
        self.gates: dict[int, asyncio.Future] = {}

    async def begin_turn(self, tid: int, kv: int) -> None:
        if not self.policy.begin_turn(tid, kv):
            self.gates[tid] = asyncio.get_running_loop().create_future()
            await self.gates[tid]

    def dispatch(self) -> None:
        for job, k in self.policy.admit():
            self.tasks[asyncio.ensure_future(self.start(job, _TurnGate(self.engines[k], job.tid, self)))] = job
        for tid in self.policy.resumable():
            self.gates.pop(tid).set_result(None)

    async def run(self) -> None:
        try:
            self.dispatch()
            while self.tasks:
                done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    job = self.tasks.pop(task)
                    traj = task.result()            # a configuration error propagates
                    self.policy.release(job.tid, len(traj.prompt_ids) + len(traj.response_ids))
                self.dispatch()
                if self.tasks and len(self.gates) == len(self.tasks):
                    raise RuntimeError(f"scheduler deadlock: all {len(self.tasks)} running trajectories are held "
                                       "and the policy resumes none (a bug in the policy)")
        finally:
            for task in self.tasks:
                task.cancel()


async def rollout_groups(engines: Engine | list[Engine], sandbox: Any, chat: Any, problems: list[str], n: int,
                         limits: RolloutLimits, seed: int | None = None,
                         scheduler: Literal["kv_aware", "static"] = "kv_aware",
                         lengths: LengthModel | None = None, group_affinity: bool = False
                         ) -> list[list[Trajectory]]:
    """n trajectories per problem, in problem order: `out[i][j]` is sample j of problems[i].

    `lengths`: the stage's `LengthModel` (kv_aware only; None starts from the max-length assumption);
    `group_affinity`: keep each problem's samples on one engine (kv_aware only; `rollout.group_affinity`)."""
    if n < 1:
        raise ValueError(f"n must be >= 1 trajectories per problem, got {n}")
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not engines:
        raise ValueError("rollout_groups needs at least one engine")
    prompt_lens = [len(chat.prompt_ids(p)) for p in problems]
    longest = max(prompt_lens, default=0) + limits.max_response_tokens
    policy = make_policy(scheduler, engines, limits.max_response_tokens, longest, lengths, group_affinity)
    policy.add(Job(i * n + j, i, prompt_lens[i]) for i in range(len(problems)) for j in range(n))
    out: list[list[Trajectory | None]] = [[None] * n for _ in problems]

    async def start(job: Job, gate: _TurnGate) -> Trajectory:
        i, j = divmod(job.tid, n)
        traj = await run_trajectory(gate, sandbox, chat, problems[i], limits, job_seed(seed, i, j))
        out[i][j] = traj
        return traj

    await _Driver(policy, engines, start).run()
    missing = sum(t is None for g in out for t in g)
    if missing:
        raise RuntimeError(f"scheduler stopped with {missing} of {len(problems) * n} trajectories never admitted "
                           "while nothing ran (a bug in the policy)")
    return out  # type: ignore[return-value]


def run_rollout_groups(*args, **kwargs) -> list[list[Trajectory]]:
    """`asyncio.run(rollout_groups(...))` for synchronous callers (tasks, scripts)."""
    return asyncio.run(rollout_groups(*args, **kwargs))


def rollout_metrics(groups: list[list[Trajectory]]) -> dict[str, float]:
    """`rollout/...` metrics of one step's groups, for the `log_metrics(dict, step)` callback."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        return {}
    calls = [c for t in trajs for c in t.tool_calls]
    count = len(trajs)
    m = {
        "rollout/trajectories": float(count),
        "rollout/response_tokens_mean": sum(len(t.response_ids) for t in trajs) / count,
        "rollout/generated_tokens_mean": sum(t.n_generated_tokens for t in trajs) / count,
        "rollout/turns_mean": sum(t.n_turns for t in trajs) / count,
        "rollout/tool_calls_per_trajectory": len(calls) / count,
        "rollout/tool_call_fail_rate": (sum(c.failed for c in calls) / len(calls)) if calls else 0.0,
        "rollout/truncated_share": sum(t.truncated for t in trajs) / count,
        "rollout/infra_error_share": sum(t.finish == "infra_error" for t in trajs) / count,
        "rollout/gen_time_s_mean": sum(t.gen_time_s for t in trajs) / count,
        "rollout/tool_time_s_mean": sum(t.tool_time_s for t in trajs) / count,
    }
    for reason in ("answer", "eos", "max_turns", "max_tokens", "infra_error"):
        m[f"rollout/finish_{reason}_share"] = sum(t.finish == reason for t in trajs) / count
    return m
