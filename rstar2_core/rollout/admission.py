"""Where and when trajectories run: the pure admission/routing policies behind `rollout_groups`.

`KVAdmission` (ours) admits on each engine's projected KV peak, holds trajectories at turn boundaries
and routes new ones to the engine with the least work left; `StaticAdmission` (verl's contiguous
chunks) is the baseline. `rollout_groups` and bench/scheduler.py drive the same objects through the
same calls (`add`, `admit`, `resumable`, `begin_turn`, `end_turn`, `release`), which carry only what a
scheduler sees from outside an engine: a trajectory's sequence length at its turn boundaries.
Invariant: the policies stay pure (no engine calls, no wall clock, no I/O): all they know arrives
through those calls, which is what lets bench/engine_sim.py measure the very code the rollout runs.
See docs/rollout-scheduling.md, "KV admission".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rstar2_core.rollout.length_model import LengthModel
from rstar2_core.rollout.types import Engine

RESERVES = ("observed", "max")


@dataclass(frozen=True)
class Job:
    """One trajectory to schedule: `tid` indexes the problem-major batch, `group` is its problem."""

    tid: int
    group: int
    prompt_tokens: int


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


@dataclass
class _Run:
    job: Job
    engine: int
    seq: int                 # admission order: lower is older
    kv: int                  # prompt + response tokens at the last turn boundary
    decoding: bool = True    # a request is in flight (since the engine clock read `since`)
    since: int = 0
    held: bool = False
    bin: int = -1            # the response-length bin it is counted in


class StaticAdmission:
    """Everything at once, on the engine of its contiguous chunk (see module docstring)."""

    def __init__(self, n_engines: int):
        if n_engines < 1:
            raise ValueError(f"static allocation needs at least one engine, got {n_engines}")
        self.n_engines = n_engines
        self._queue: list[Job] = []
        self.stats = {"holds": 0, "steals": 0}

    def add(self, jobs: Iterable[Job]) -> None:
        self._queue.extend(jobs)

    def admit(self) -> list[tuple[Job, int]]:
        jobs, self._queue = self._queue, []
        return list(zip(jobs, static_assignment(len(jobs), self.n_engines)))

    def resumable(self) -> list[int]:
        return []

    def begin_turn(self, tid: int, kv: int) -> bool:
        return True

    def end_turn(self, tid: int, kv: int) -> None:
        pass

    def release(self, tid: int, kv: int) -> None:
        pass


class KVAdmission:
    """KV-aware admission on projected KV use, turn-boundary holds and group routing (module docstring).

    capacities: KV tokens per engine; per_sequence: what one sequence reserves on each engine (0 = paged;
    HF slots: max_seq_len); max_response_tokens: the stage's limit; lengths: the stage's `LengthModel`
    (a fresh one if None). `reserve="max"` is the paper's rule (prompt + max_response_tokens per
    trajectory until it finishes). `group_affinity=True` keeps a group's samples on one engine.
    `admit_sigmas`: standard deviations of the projected peak kept free at admission (5: no
    recomputed token in bench/scheduler.py's workloads at GPU-like and CPU costs; 4 recomputed a few).
    """

    def __init__(self, capacities: Sequence[int], per_sequence: Sequence[int] | None = None, *,
                 max_response_tokens: int, lengths: LengthModel | None = None, reserve: str = "observed",
                 group_affinity: bool = False, admit_sigmas: float = 5.0):
        if not capacities or any(c < 1 for c in capacities):
            raise ValueError(f"every engine needs a positive KV capacity, got {list(capacities)}")
        if reserve not in RESERVES:
            raise ValueError(f"unknown reserve {reserve!r}; valid: {list(RESERVES)}")
        if admit_sigmas < 0:
            raise ValueError(f"admit_sigmas must be >= 0, got {admit_sigmas}")
        if lengths is not None and lengths.max_tokens != max_response_tokens:
            raise ValueError(f"the LengthModel was built for max_tokens={lengths.max_tokens} but the stage's "
                             f"max_response_tokens is {max_response_tokens}; use one LengthModel per stage")
        n = len(capacities)
        self.capacity = [int(c) for c in capacities]
        self.admit_sigmas = admit_sigmas
        self.per_sequence = [int(p) for p in (per_sequence or [0] * n)]
        if len(self.per_sequence) != n:
            raise ValueError(f"per_sequence needs one value per engine ({n}), got {len(self.per_sequence)}")
        self.max_response = max_response_tokens
        self.lengths = lengths if lengths is not None else LengthModel(max_response_tokens)
        self.reserve, self.group_affinity = reserve, group_affinity
        self._fresh: deque[deque[Job]] = deque()                        # units not started anywhere
        self._homed: list[dict[int, deque[Job]]] = [{} for _ in range(n)]   # queued samples by home
        self._home: dict[int, int] = {}
        self._runs: dict[int, _Run] = {}
        self._ages: list[list[_Run]] = [[] for _ in range(n)]           # runs per engine, oldest first
        self._clock = [0] * n              # decode steps each engine has run, as turn ends reveal them
        self._binned_at = [0] * n          # the clock its running trajectories were binned with
        nb = self.lengths.n_bins
        # per engine, running trajectories (not held) by response-length bin: count, prompt sum, prompt^2 sum
        self._cnt, self._psum, self._psq = np.zeros((n, nb)), np.zeros((n, nb)), np.zeros((n, nb))
        self._groups: list[dict[int, int]] = [{} for _ in range(n)]     # their groups, for the design effect
        self._gsq, self._nrun = np.zeros(n), np.zeros(n)                 # sum of squared group counts, count
        self._held_kv, self._held_bins = np.zeros(n), np.zeros(nb)
        self._n_held = [0] * n
        self._dirty = np.ones(n, dtype=bool)
        self._mean, self._var2, self._full_kv = np.zeros((n, nb)), np.zeros((n, nb)), np.zeros((n, nb))
        self._table_version = -1
        self._seq = 0
        self._step = object()              # groups of this call are not the same problems as the last call's
        self.stats = {"holds": 0, "steals": 0}

    # ----------------------------------------------------------------------------------- events
    def add(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            need = job.prompt_tokens + self.max_response
            if all(need > c for c in self.capacity):
                raise ValueError(f"a trajectory needs up to {need} KV tokens (prompt + max_response_tokens) but "
                                 f"no engine holds that many (capacities {self.capacity}); lower "
                                 "max_response_tokens or raise the engines' KV capacity / max_seq_len")
            home = self._home.get(job.group) if self.group_affinity else None
            if home is not None:
                self._homed[home].setdefault(job.group, deque()).append(job)
            elif self.group_affinity and self._fresh and self._fresh[-1][0].group == job.group:
                self._fresh[-1].append(job)
            else:
                self._fresh.append(deque([job]))

    def admit(self) -> list[tuple[Job, int]]:
        """New trajectories to start now, with their engine (held ones that may go on: `resumable`)."""
        out: list[tuple[Job, int]] = []
        for e in range(len(self.capacity)):
            self._fill_home(e, out)
        while self._fresh:
            e = self.route(self._fresh[0][0])
            if e is None:
                break
            unit = self._fresh.popleft()
            key = unit[0].group if self.group_affinity else -1 - unit[0].tid
            if self.group_affinity:
                self._home[key] = e
            self._homed[e][key] = unit
            self._fill_home(e, out)
        if self.group_affinity and not self._fresh:
            for e in sorted(range(len(self.capacity)), key=self.free, reverse=True):
                while not any(self._homed[e].values()):
                    queued = self._largest_queue(exclude=e)
                    if queued is None or not self._fits(e, queued[0]):
                        break
                    self.stats["steals"] += 1
                    self._start(queued.popleft(), e, out)
        return out

    def route(self, job: Job) -> int | None:
        """Engine for a new trajectory (or a new group's first sample, with group affinity): of those it
        fits, the one with the least expected decode work left (ties: the most room left after it)."""
        fits = self._fits_all(job)
        if not fits.any():
            return None
        work, room = self._work_all(), self._projected_all(job, self.admit_sigmas) - np.array(self.capacity)
        return int(min(np.flatnonzero(fits), key=lambda e: (work[e], room[e])))

    def remaining_work(self, e: int) -> float:
        """Expected response tokens the running trajectories on engine e have still to generate."""
        return float(self._work_all()[e])

    def resumable(self) -> list[int]:
        """Held trajectories that may take their next turn now (oldest first); they are running again."""
        out = []
        for e in range(len(self.capacity)):
            for run in list(self._ages[e]) if self._n_held[e] else ():
                if run.held:
                    self._set(run, held=False, decoding=True)
                    if self._ages[e][0] is run or self.projected(e) <= self.capacity[e]:
                        out.append(run.job.tid)
                    else:
                        self._set(run, held=True, decoding=False)
        return out

    def begin_turn(self, tid: int, kv: int) -> bool:
        """Before a later turn (kv includes the tool response): True = go on, False = held."""
        run = self._runs[tid]
        self._set(run, kv=kv, decoding=True)
        if self._ages[run.engine][0] is run or self.projected(run.engine) <= self.capacity[run.engine]:
            return True
        self._set(run, held=True, decoding=False)
        self.stats["holds"] += 1
        return False

    def end_turn(self, tid: int, kv: int) -> None:
        """After a turn's generation: kv = the sequence's length now. Advances the engine's clock."""
        run = self._runs[tid]
        e = run.engine
        if run.decoding:
            self._clock[e] = max(self._clock[e], run.since + max(0, kv - run.kv))
        self._set(run, kv=kv, decoding=False)
        if 2 * (self._clock[e] - self._binned_at[e]) >= self.lengths.bin_tokens:
            self._rebin(e)

    def release(self, tid: int, kv: int) -> None:
        """The trajectory finished at `kv` tokens: its KV is freed and its length observed."""
        run = self._runs.pop(tid)
        self._count(run, -1)
        if run.held:
            self._n_held[run.engine] -= 1
        self._ages[run.engine].remove(run)
        self.lengths.observe(kv - run.job.prompt_tokens, (self._step, run.job.group))

    # ---------------------------------------------------------------------------------- queries
    def projected(self, e: int, job: Job | None = None, sigmas: float = 0.0) -> float:
        """Peak over the coming decode steps of the expected KV tokens on engine e (with `job` added),
        plus `sigmas` standard deviations: running trajectories grow a token a step and leave when they
        finish, independently, by the length model; held ones stay at their current length. On slot
        engines: a slot per trajectory."""
        if self.per_sequence[e]:
            return float((len(self._ages[e]) + (job is not None)) * self.per_sequence[e])
        if self.reserve == "max":
            return float(sum(r.kv if r.held else r.job.prompt_tokens + self.max_response for r in self._ages[e])
                         + (job.prompt_tokens + self.max_response if job is not None else 0))
        self._curves()
        mean, var, full = self._mean[e], self._var2[e], self._full_kv[e]
        if job is not None:
            p = job.prompt_tokens
            mean = mean + self._rows[0] + p * self._ratio[0]
            var = var + self._var[2][0] + p * self._var[1][0] + p * p * self._var[0][0]
            full = full + self._full[0] + p * self._alive[0]
        curve = np.minimum(mean + sigmas * np.sqrt(var), full) if sigmas else mean
        return float(curve.max()) + float(self._held_kv[e])

    def free(self, e: int) -> float:
        return self.capacity[e] - self.projected(e)

    def length(self, tid: int) -> int:
        """Estimated current sequence length: at the last boundary, plus the engine's decode steps since
        the turn began while a request is in flight."""
        run = self._runs[tid]
        return self._length(run)

    # -------------------------------------------------------------------------------- internals
    def _length(self, run: _Run) -> int:
        grown = self._clock[run.engine] - run.since if run.decoding else 0
        return min(run.kv + grown, run.job.prompt_tokens + self.max_response)

    def _refresh(self) -> None:
        """Rebuild the survival tables when a trajectory has finished since the last build.

        `_ratio[b, j]` = P(still running j bins later | in bin b now); `_rows[b, j]` = that times the
        response length then (the bin's upper edge, at most max_response)."""
        lm = self.lengths
        if self._table_version == lm.version:
            return
        nb = lm.n_bins
        s = lm.survival((self._cnt.sum(axis=0) + self._held_bins).astype(np.int64))
        idx = np.arange(nb)[:, None] + np.arange(nb)[None, :]          # b + j
        valid = idx < nb
        s_at = np.where(valid, s[np.minimum(idx, nb)], 0.0)
        base = s[:nb, None]
        ratio = np.where(base > 0, s_at / np.where(base > 0, base, 1.0), valid.astype(float))
        length = np.minimum((idx + 1) * lm.bin_tokens, self.max_response)
        spread = ratio * (1.0 - ratio)                                   # Bernoulli variance of running
        self._icc = lm.group_correlation()
        self._ratio, self._rows = ratio, ratio * length
        self._alive = (ratio > 0).astype(float)                          # could still be running then
        self._full = self._alive * length
        self._var = (spread, 2.0 * length * spread, length * length * spread)   # x prompt^0, ^1, ^2
        self._work = ratio.sum(axis=1) * lm.bin_tokens                   # expected tokens still to come
        self._table_version = lm.version
        self._dirty[:] = True

    def _curves(self) -> None:
        """Bring each changed engine's curves over the coming bins of decode steps up to date: the mean
        and variance of its KV (the variance times its groups' design effect), and `_full_kv`, its KV
        if every trajectory that could still run did (the bound for mean + sigmas)."""
        self._refresh()
        if not self._dirty.any():
            return
        d = np.flatnonzero(self._dirty)
        cnt, psum, psq = self._cnt[d], self._psum[d], self._psq[d]
        v0, v1, v2 = self._var
        self._mean[d] = cnt @ self._rows + psum @ self._ratio
        m = np.divide(self._gsq[d], self._nrun[d], out=np.ones(len(d)), where=self._nrun[d] > 0)
        design = 1.0 + (m - 1.0) * self._icc                             # samples of one group are alike
        self._var2[d] = (cnt @ v2 + psum @ v1 + psq @ v0) * design[:, None]
        self._full_kv[d] = cnt @ self._full + psum @ self._alive
        self._dirty[d] = False

    def _projected_all(self, job: Job, sigmas: float) -> np.ndarray:
        """`projected(e, job, sigmas)` for every engine at once."""
        n = len(self.capacity)
        if self.reserve == "max" or any(self.per_sequence):
            return np.array([self.projected(e, job, sigmas) for e in range(n)])
        self._curves()
        p = job.prompt_tokens
        mean = self._mean + (self._rows[0] + p * self._ratio[0])
        var = self._var2 + (self._var[2][0] + p * self._var[1][0] + p * p * self._var[0][0])
        full = self._full_kv + (self._full[0] + p * self._alive[0])
        return np.minimum(mean + sigmas * np.sqrt(var), full).max(axis=1) + self._held_kv

    def _work_all(self) -> np.ndarray:
        self._refresh()
        return self._cnt @ self._work

    def _fits_all(self, job: Job) -> np.ndarray:
        cap = np.array(self.capacity, dtype=float)
        ok = (job.prompt_tokens + self.max_response <= cap) & (np.array(self._n_held) == 0)
        return ok & (self._projected_all(job, self.admit_sigmas) <= cap)

    def _fits(self, e: int, job: Job) -> bool:
        if job.prompt_tokens + self.max_response > self.capacity[e] or self._n_held[e]:
            return False                 # it could never finish there / held trajectories go first
        return self.projected(e, job, sigmas=self.admit_sigmas) <= self.capacity[e]

    def _binned_length(self, run: _Run) -> int:
        """The length the histograms count `run` at: as `_length`, with the clock of the last binning."""
        at = self._binned_at[run.engine]
        grown = at - run.since if run.decoding and at > run.since else 0
        return min(run.kv + grown, run.job.prompt_tokens + self.max_response)

    def _count(self, run: _Run, sign: int) -> None:
        """Add (+1) or remove (-1) `run` from its engine's histograms."""
        e, p, g = run.engine, run.job.prompt_tokens, run.job.group
        if sign > 0:
            run.bin = self.lengths.bin((run.kv if run.held else self._binned_length(run)) - p)
        b = run.bin
        if run.held:
            self._held_kv[e] += sign * run.kv
            self._held_bins[b] += sign
        else:
            self._cnt[e, b] += sign
            self._psum[e, b] += sign * p
            self._psq[e, b] += sign * p * p
            c = self._groups[e].get(g, 0)
            self._gsq[e] += 2 * c + 1 if sign > 0 else -(2 * c - 1)
            self._groups[e][g] = c + sign
            self._nrun[e] += sign
        self._dirty[e] = True

    def _rebin(self, e: int) -> None:
        """Re-bin engine e's trajectories at its current clock (done when it moved half a bin)."""
        for run in self._ages[e]:
            self._count(run, -1)
        self._binned_at[e] = self._clock[e]
        for run in self._ages[e]:
            self._count(run, +1)

    def _set(self, run: _Run, *, kv: int | None = None, decoding: bool | None = None,
             held: bool | None = None) -> None:
        self._count(run, -1)
        if kv is not None:
            run.kv = kv
        if decoding is not None:
            if decoding and not run.decoding:
                run.since = self._clock[run.engine]
            run.decoding = decoding
        if held is not None and held != run.held:
            run.held = held
            self._n_held[run.engine] += 1 if held else -1
        self._count(run, +1)

    def _fill_home(self, e: int, out: list[tuple[Job, int]]) -> None:
        for key, queued in list(self._homed[e].items()):
            while queued and self._fits(e, queued[0]):
                self._start(queued.popleft(), e, out)
            if queued:
                return                   # keep the order: later groups on this engine wait too
            del self._homed[e][key]

    def _largest_queue(self, exclude: int) -> deque[Job] | None:
        best: deque[Job] | None = None
        for e in range(len(self.capacity)):
            if e != exclude:
                for queued in self._homed[e].values():
                    if queued and (best is None or len(queued) > len(best)):
                        best = queued
        return best

    def _start(self, job: Job, e: int, out: list[tuple[Job, int]]) -> None:
        run = _Run(job, e, self._seq, job.prompt_tokens, since=self._clock[e])
        self._seq += 1
        self._runs[job.tid] = run
        self._ages[e].append(run)                 # seq grows: the list stays oldest first
        self._count(run, +1)
        out.append((job, e))


def engine_kv(engines: Sequence[Engine]) -> tuple[list[int], list[int]]:
    """(KV capacity, per-sequence reservation) of each engine; the latter 0 when the engine pages KV."""
    caps = [int(e.kv_capacity_tokens()) for e in engines]
    per = [int(getattr(e, "kv_tokens_per_sequence", lambda: 0)()) for e in engines]
    return caps, per
