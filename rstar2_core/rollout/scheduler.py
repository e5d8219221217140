"""Rollout of groups across several engines: KV-cache-aware admission (the paper) or static N-per-engine.

    groups = run_rollout_groups(engines, sandbox, chat, problems, n=16, limits=limits, seed=0)
    # groups[i][j]: j-th trajectory of problems[i]

`kv_aware` (RECIPE.md, "Rollout scheduling"): each trajectory reserves its worst-case KV footprint,
prompt + max_response_tokens tokens, on one engine (at least `engine.kv_tokens_per_sequence()` when
the engine reports one: an HF engine's slot is max_seq_len tokens whatever the sequence uses); an engine admits trajectories only while their
reservations fit its `kv_capacity_tokens()`, the engine with the most free capacity gets the next
one, and the moment a trajectory finishes its reservation is released and the next waiting one is
admitted there. A trajectory stays on its engine for all its turns (the engine's prefix cache
holds its KV between turns), and its tool calls go to the sandbox as soon as they are generated
(`agent.run_trajectory`). No engine is ever asked to hold more than its KV cache, so nothing is
preempted or recomputed.

`static` (the baseline, verl-style): the problem-major batch (a group's samples consecutive) is cut
into one contiguous chunk per engine up front (`static_assignment`: how verl splits its repeated batch
across rollout workers, and what sending a prompt with vLLM's `n` does) and all of it launched at
once; each engine queues (HF) or preempts and recomputes (vLLM) what it cannot hold, and an engine
that finished its share idles while others still work through theirs.

Departure from the paper: admission reserves the full max length per trajectory (the paper's rule)
rather than tracking actual KV use; with HF engines capacity is slots x max_seq_len, so this is the
exact condition for never waiting on a slot mid-trajectory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rstar2_core.rollout.agent import run_trajectory
from rstar2_core.rollout.types import Engine, RolloutLimits, Trajectory

SCHEDULERS = ("kv_aware", "static")


class KVAdmission:
    """Pure admission bookkeeping: per-engine capacity (tokens) and what running trajectories reserve."""

    def __init__(self, capacities: Sequence[int], min_reservation: Sequence[int] | None = None):
        if not capacities or any(c < 1 for c in capacities):
            raise ValueError(f"every engine needs a positive KV capacity, got {list(capacities)}")
        self.capacity = list(capacities)
        self.min_reservation = list(min_reservation or [0] * len(capacities))
        self.reserved = [0] * len(capacities)

    def free(self, engine: int) -> int:
        return self.capacity[engine] - self.reserved[engine]

    def cost(self, engine: int, tokens: int) -> int:
        """What `tokens` reserve on `engine` (an HF engine reserves a whole slot per sequence)."""
        return max(tokens, self.min_reservation[engine])

    def try_admit(self, tokens: int) -> int | None:
        """Reserve `tokens` on the engine with the most room left after it; None if none has room."""
        fits = [k for k in range(len(self.capacity)) if self.cost(k, tokens) <= self.capacity[k]]
        if not fits:
            raise ValueError(f"a trajectory needs up to {tokens} KV tokens but no engine holds that many "
                             f"(capacities {self.capacity}); lower max_response_tokens or raise the engines' "
                             "KV capacity / max_seq_len")
        best = max(fits, key=lambda k: self.free(k) - self.cost(k, tokens))
        if self.free(best) < self.cost(best, tokens):
            return None
        self.reserved[best] += self.cost(best, tokens)
        return best

    def release(self, engine: int, tokens: int) -> None:
        c = self.cost(engine, tokens)
        if c > self.reserved[engine]:
            raise ValueError(f"release of {c} tokens on engine {engine} that reserves only {self.reserved[engine]}")
        self.reserved[engine] -= c


@dataclass(frozen=True)
class _Job:
    problem_index: int
    sample_index: int
    problem: str
    seed: int | None
    tokens: int        # worst-case KV footprint: prompt + max_response_tokens


def static_assignment(n_jobs: int, n_engines: int) -> list[int]:
    """Engine of job i under `static`: contiguous chunks, sizes differing by at most one.

    Jobs are problem-major, so a group's samples land on one engine (or two, at a chunk border), as in
    verl (prompts repeated n times with `interleave=True`, then one contiguous chunk per rollout worker).
    """
    if n_engines < 1:
        raise ValueError(f"static allocation needs at least one engine, got {n_engines}")
    base, extra = divmod(n_jobs, n_engines)
    out: list[int] = []
    for k in range(n_engines):
        out.extend([k] * (base + (k < extra)))
    return out


def job_seed(seed: int | None, problem_index: int, sample_index: int) -> int | None:
    """Seed of trajectory j of problem i: the same (seed, i, j) gives the same trajectory on any engine."""
    return None if seed is None else (seed * 1_000_033 + problem_index) * 65_537 + sample_index


async def rollout_groups(engines: Engine | list[Engine], sandbox: Any, chat: Any, problems: list[str], n: int,
                         limits: RolloutLimits, seed: int | None = None,
                         scheduler: Literal["kv_aware", "static"] = "kv_aware") -> list[list[Trajectory]]:
    """n trajectories per problem, in problem order: `out[i][j]` is sample j of problems[i]."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; valid: {list(SCHEDULERS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1 trajectories per problem, got {n}")
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not engines:
        raise ValueError("rollout_groups needs at least one engine")
    jobs = [_Job(i, j, p, job_seed(seed, i, j), len(chat.prompt_ids(p)) + limits.max_response_tokens)
            for i, p in enumerate(problems) for j in range(n)]
    longest = max((j.tokens for j in jobs), default=0)
    for e in engines:
        per_seq = getattr(e, "kv_tokens_per_sequence", lambda: 0)()
        if per_seq and longest > per_seq - 1:
            raise ValueError(f"a trajectory may reach {longest} tokens (prompt + max_response_tokens) but the "
                             f"engine holds sequences of at most {per_seq - 1}; raise its max_seq_len or lower "
                             "max_response_tokens")
    out: list[list[Trajectory | None]] = [[None] * n for _ in problems]

    async def run(job: _Job, engine: Engine) -> None:
        out[job.problem_index][job.sample_index] = await run_trajectory(engine, sandbox, chat, job.problem,
                                                                        limits, job.seed)

    if scheduler == "static":
        share = static_assignment(len(jobs), len(engines))
        await asyncio.gather(*(run(job, engines[k]) for job, k in zip(jobs, share)))
    else:
        await _kv_aware(jobs, engines, run)
    return out  # type: ignore[return-value]


async def _kv_aware(jobs: list[_Job], engines: list[Engine], run) -> None:
    admission = KVAdmission([e.kv_capacity_tokens() for e in engines],
                            [getattr(e, "kv_tokens_per_sequence", lambda: 0)() for e in engines])
    waiting = list(reversed(jobs))              # pop() takes them in order
    running: dict[asyncio.Task, tuple[int, _Job]] = {}

    def fill() -> None:
        while waiting:
            k = admission.try_admit(waiting[-1].tokens)
            if k is None:
                return
            job = waiting.pop()
            running[asyncio.ensure_future(run(job, engines[k]))] = (k, job)

    try:
        fill()
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                k, job = running.pop(task)
                admission.release(k, job.tokens)
                task.result()                   # a configuration error propagates
            fill()
    finally:
        for task in running:
            task.cancel()


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
