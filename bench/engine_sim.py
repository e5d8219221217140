"""Discrete-event model of N inference engines, driven by the scheduling policies of `admission.py`.

`simulate(trajectories, policy, n_engines, capacity, cost)` replays a workload of multi-turn trajectories
through `policy` (`StaticAdmission`, `KVAdmission`: the objects `rollout_groups` uses, called the same way)
and a simplified model of vLLM's (V1) paged engines, and reports the makespan and the KV tokens the
engines had to recompute. bench/scheduler.py runs it at the paper's scale; the tests pin its properties.
Invariant: the policies are called exactly as `rollout_groups` calls them (`add`, `admit`, `resumable`,
`begin_turn`, `end_turn`, `release`), so the figures measure that code.
See docs/benchmarks.md, "bench/engine_sim.py" (the engine model and what it leaves out).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from rstar2_core.rollout.admission import Job


@dataclass(frozen=True)
class Cost:
    """Engine costs: `a` s per decode step, `b` s per sequence in it, `c` s per KV token it reads,
    `p` s per prefilled token."""

    a: float
    b: float
    c: float
    p: float

    def steps(self, k: int, batch: int, kv0: int) -> float:
        """k decode steps of `batch` sequences from kv0 resident tokens (the KV grows by batch a step)."""
        return k * (self.a + self.b * batch + self.c * kv0) + self.c * batch * k * (k - 1) / 2


@dataclass
class SimTrajectory:
    """One trajectory of a workload: `turns[i]` tokens sampled in turn i, `tools[i]` seconds of tool
    after turn i (all turns but the last), `tool_tokens` appended after each call."""

    tid: int
    group: int
    prompt: int
    turns: list[int]
    tools: list[float]
    tool_tokens: int

    @property
    def response_tokens(self) -> int:
        return sum(self.turns) + (len(self.turns) - 1) * self.tool_tokens


def workload(n: int, mean_len: float, max_len: int, prompt: int, seed: int, group_size: int = 1,
             problem_share: float = 0.0) -> list[SimTrajectory]:
    """n trajectories in problem-major order (group_size consecutive ones share a problem).

    Response length is lognormal (sigma 1, mean `mean_len`, capped at `max_len`); `problem_share` of its
    log-variance comes from the problem (hard problems make every sample of the group long), the rest
    is per sample. 1-10 assistant turns (mean ~2.9), 120 tool tokens per call, tool waits lognormal
    with mean 0.3 s (the paper's mean tool latency).
    """
    if not 0.0 <= problem_share <= 1.0:
        raise ValueError(f"problem_share must be in [0, 1], got {problem_share}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rng = random.Random(seed)
    sigma = 1.0
    mu = math.log(mean_len) - sigma ** 2 / 2
    out = []
    z_problem = 0.0
    for i in range(n):
        if i % group_size == 0:
            z_problem = rng.gauss(0.0, 1.0)
        z = math.sqrt(problem_share) * z_problem + math.sqrt(1.0 - problem_share) * rng.gauss(0.0, 1.0)
        total = max(64, min(max_len, int(math.exp(mu + sigma * z))))
        k = max(1, min(10, 1 + int(rng.expovariate(1 / 2.5))))
        tool_tokens = 120
        sampled = max(k, total - (k - 1) * tool_tokens)
        cuts = sorted(rng.sample(range(1, sampled), k - 1)) if k > 1 and sampled > k else []
        turns = [max(1, b - a) for a, b in zip([0, *cuts], [*cuts, sampled])] or [sampled]
        tools = [rng.lognormvariate(math.log(0.3) - 0.5 ** 2 / 2, 0.5) for _ in turns[:-1]]
        out.append(SimTrajectory(i, i // group_size, prompt, turns, tools, tool_tokens))
    return out


@dataclass(eq=False)
class _Seq:
    traj: SimTrajectory
    engine: int
    turn: int = 0
    left: int = 0           # tokens still to sample in this turn
    length: int = 0         # tokens of the sequence (prompt + response so far)
    new: int = 0            # tokens the pending request adds (prompt, or the tool response)
    evicted: bool = False   # its KV was dropped: the next admission prefills `length + new`
    order: int = 0          # admission order on the engine (vLLM preempts the newest)


@dataclass(eq=False)
class _Engine:
    capacity: int
    max_seqs: int
    running: list[_Seq] = field(default_factory=list)
    waiting: deque[_Seq] = field(default_factory=deque)
    cached: OrderedDict = field(default_factory=OrderedDict)   # _Seq -> None, least recently used first
    pinned: int = 0         # KV tokens of running sequences
    cached_tokens: int = 0
    groups: dict = field(default_factory=dict)                 # group -> resident/cached samples
    chunk: tuple | None = None   # (start, prefill_s, k, batch, kv0, version)
    version: int = 0
    order: int = 0
    recomputed: int = 0
    busy_s: float = 0.0
    steps: int = 0
    seq_steps: int = 0


@dataclass(frozen=True)
class SimResult:
    makespan_s: float
    recomputed_tokens: int
    evictions: int
    preemptions: int
    holds: int
    steals: int
    mean_batch: float
    engine_busy_s: tuple[float, ...]


def simulate(trajectories: list[SimTrajectory], policy, n_engines: int, capacity: int, cost: Cost,
             max_seqs: int = 256, max_chunk: int = 16) -> SimResult:
    """Run `trajectories` through `policy` on `n_engines` engines of `capacity` KV tokens each.

    `max_chunk`: most decode steps simulated as one event when the cache must be evicted to grow
    (finer is slower to simulate and changes results by well under 1%)."""
    engines = [_Engine(capacity, max_seqs) for _ in range(n_engines)]
    by_tid = {tr.tid: tr for tr in trajectories}
    seqs: dict[int, _Seq] = {}
    events: list[tuple] = []
    state = {"tie": 0, "finished": 0, "last": 0.0, "evictions": 0, "preemptions": 0}

    def push(t: float, kind: str, data) -> None:
        heapq.heappush(events, (t, state["tie"], kind, data))
        state["tie"] += 1

    def evict(e: _Engine, need: int) -> None:
        """Drop cached sequences (least recently used first) until `need` more tokens fit."""
        while e.cached and e.pinned + e.cached_tokens + need > e.capacity:
            s, _ = e.cached.popitem(last=False)
            e.cached_tokens -= s.length
            s.evicted = True
            state["evictions"] += 1
            _leave_group(e, s)

    def preempt(e: _Engine) -> None:
        victim = max(e.running, key=lambda s: s.order)
        e.running.remove(victim)
        e.pinned -= victim.length
        victim.evicted = True
        state["preemptions"] += 1
        _leave_group(e, victim)
        e.waiting.appendleft(victim)

    def submit(s: _Seq, t: float) -> None:
        e = engines[s.engine]
        e.waiting.append(s)
        if e.chunk is None:
            start(s.engine, t)
        else:
            interrupt(s.engine, t)

    def interrupt(i: int, t: float) -> None:
        """Cut engine i's chunk at the first step boundary at or after t, where the request joins."""
        e = engines[i]
        t0, pre, k, batch, kv0, _ = e.chunk
        if k <= 1 or t0 + pre + cost.steps(k - 1, batch, kv0) < t:
            return
        lo, hi = 1, k - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if t0 + pre + cost.steps(mid, batch, kv0) >= t:
                hi = mid
            else:
                lo = mid + 1
        e.version += 1
        e.chunk = (t0, pre, lo, batch, kv0, e.version)
        push(t0 + pre + cost.steps(lo, batch, kv0), "chunk", (i, e.version))

    def start(i: int, t: float) -> None:
        """Admit what fits from the engine's queue, then launch its next chunk of decode steps."""
        e = engines[i]
        prefill = 0
        while e.waiting and len(e.running) < e.max_seqs:
            s = e.waiting[0]
            resident = s in e.cached
            grow = s.new + (s.length if resident or s.evicted else 0)
            if e.pinned + grow + len(e.running) + 1 > e.capacity:     # room for it and one step of all
                break
            e.waiting.popleft()
            if resident:
                del e.cached[s]
                e.cached_tokens -= s.length
            e.pinned += grow
            evict(e, 0)
            if s.evicted:
                e.recomputed += s.length
                prefill += s.length + s.new
                s.evicted = False
                _join_group(e, s)
            elif s.length == 0:                                        # a new trajectory
                prefill += 0 if e.groups.get(s.traj.group, 0) else s.new
                _join_group(e, s)
            else:
                prefill += s.new
            s.length += s.new
            s.new = 0
            e.order += 1
            s.order = e.order
            e.running.append(s)
        if not e.running:
            e.chunk = None
            return
        k = min(s.left for s in e.running)
        evict(e, len(e.running) * min(k, max_chunk))
        while e.pinned + len(e.running) > e.capacity and len(e.running) > 1:
            preempt(e)
        batch = len(e.running)
        k = max(1, min(k, (e.capacity - e.pinned - e.cached_tokens) // batch))
        kv0 = e.pinned
        e.version += 1
        e.chunk = (t, prefill * cost.p, k, batch, kv0, e.version)
        push(t + prefill * cost.p + cost.steps(k, batch, kv0), "chunk", (i, e.version))

    def end_chunk(i: int, t: float) -> None:
        e = engines[i]
        t0, _, k, batch, _, _ = e.chunk
        e.chunk = None
        e.busy_s += t - t0
        e.steps += k
        e.seq_steps += k * batch
        for s in list(e.running):
            s.left -= k
            s.length += k
            e.pinned += k
            if s.left:
                continue
            e.running.remove(s)
            e.pinned -= s.length
            s.turn += 1
            tr = s.traj
            if s.turn == len(tr.turns):
                state["finished"] += 1
                state["last"] = t
                _leave_group(e, s)
                policy.end_turn(tr.tid, s.length)
                policy.release(tr.tid, s.length)
            else:
                e.cached[s] = None
                e.cached_tokens += s.length
                policy.end_turn(tr.tid, s.length)
                push(t + tr.tools[s.turn - 1], "tool", s)
        dispatch(t)
        if e.chunk is None:
            start(i, t)

    def resume(s: _Seq, t: float) -> None:
        e = engines[s.engine]
        if s in e.cached:
            e.cached.move_to_end(s)
        s.left = s.traj.turns[s.turn]
        submit(s, t)

    def dispatch(t: float) -> None:
        for job, k in policy.admit():
            tr = by_tid[job.tid]
            s = _Seq(tr, k, left=tr.turns[0], new=tr.prompt)
            seqs[tr.tid] = s
            submit(s, t)
        for tid in policy.resumable():
            resume(seqs[tid], t)

    policy.add(Job(tr.tid, tr.group, tr.prompt) for tr in trajectories)
    dispatch(0.0)
    while events:
        t, _, kind, data = heapq.heappop(events)
        if kind == "chunk":
            i, version = data
            if engines[i].chunk is not None and engines[i].chunk[5] == version:
                end_chunk(i, t)
        else:
            s = data
            s.new = s.traj.tool_tokens
            if policy.begin_turn(s.traj.tid, s.length + s.new):
                resume(s, t)
    if state["finished"] != len(trajectories):
        raise RuntimeError(f"simulation lost trajectories ({state['finished']}/{len(trajectories)} finished): the "
                           "policy never admitted or resumed the rest")
    steps = sum(e.steps for e in engines)
    return SimResult(makespan_s=state["last"], recomputed_tokens=sum(e.recomputed for e in engines),
                     evictions=state["evictions"], preemptions=state["preemptions"],
                     holds=policy.stats["holds"], steals=policy.stats["steals"],
                     mean_batch=sum(e.seq_steps for e in engines) / max(1, steps),
                     engine_busy_s=tuple(round(e.busy_s, 2) for e in engines))


def _join_group(e: _Engine, s: _Seq) -> None:
    e.groups[s.traj.group] = e.groups.get(s.traj.group, 0) + 1


def _leave_group(e: _Engine, s: _Seq) -> None:
    e.groups[s.traj.group] -= 1
