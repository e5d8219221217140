"""Admission policies: the paper's rule when nothing is known, more concurrency once lengths are learnt,
holds at turn boundaries, the engine clock read from turn ends, slot engines, and invariants under
random event sequences (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_core.rollout.admission import Job, KVAdmission, StaticAdmission, static_assignment
from rstar2_core.rollout.length_model import LengthModel

P, MAX = 100, 1000                     # prompt tokens, max response tokens


def _jobs(n: int, group_size: int = 1, start: int = 0) -> list[Job]:
    return [Job(start + i, (start + i) // group_size, P) for i in range(n)]


def _warm(lengths, max_tokens: int = MAX) -> LengthModel:
    lm = LengthModel(max_tokens)
    for n in lengths:
        lm.observe(n)
    return lm


def test_survival_is_the_empirical_one_and_keeps_unknown_mass_at_the_maximum():
    lm = _warm([100] * 50 + [500] * 50)
    s = lm.survival(np.zeros(lm.n_bins, dtype=np.int64))
    assert s[0] == 1.0 and s[lm.bin(100)] == 1.0 and s[lm.bin(100) + 1] == pytest.approx(0.5)
    assert s[lm.bin(500) + 1] == 0.0 and s[lm.n_bins] == 0.0
    censored = np.zeros(lm.n_bins, dtype=np.int64)
    censored[lm.bin(600)] = 100                       # 100 still running past every observed length
    s = lm.survival(censored)
    assert s[lm.bin(100) + 1] == pytest.approx(150 / 200)   # Kaplan-Meier: censored ones stay at risk
    assert s[lm.n_bins - 1] == pytest.approx(s[lm.bin(600)]) and s[lm.bin(600)] > 0   # mass at the maximum
    cold = LengthModel(MAX).survival(np.zeros(LengthModel(MAX).n_bins, dtype=np.int64))
    assert np.all(cold[:-1] == 1.0)                   # nothing observed: everything reaches the maximum


def test_group_correlation_measures_how_alike_a_groups_lengths_are():
    g = np.random.default_rng(0)
    alike, apart = LengthModel(MAX), LengthModel(MAX)
    for group in range(40):
        level = g.integers(50, 900)
        for _ in range(4):
            alike.observe(int(level + g.integers(-10, 10)), ("s", group))
            apart.observe(int(g.integers(50, 900)), ("s", group))
    assert alike.group_correlation() > 0.9 and apart.group_correlation() < 0.2
    assert LengthModel(MAX).group_correlation() == 0.0          # nothing to measure yet


def test_alike_groups_make_admission_more_careful():
    """The same 240 observed lengths, grouped alike or shuffled across groups: with alike groups an engine
    full of one group's samples may have them all long, so fewer are admitted."""
    g = np.random.default_rng(1)
    lengths = [int(x) for x in np.repeat(g.integers(50, 900, 60), 4)]
    shuffled = [int(x) for x in g.permutation(lengths)]

    def admitted(values) -> int:
        lm = LengthModel(MAX)
        for i, n in enumerate(values):
            lm.observe(n, ("prev", i // 4))
        pol = KVAdmission([12 * (P + MAX)], max_response_tokens=MAX, lengths=lm, group_affinity=True)
        pol.add(_jobs(64, group_size=16))
        return len(pol.admit())
    assert admitted(lengths) < admitted(shuffled)


def test_cold_model_admits_by_the_paper_rule_and_learnt_lengths_admit_more():
    cap = 3 * (P + MAX)
    cold = KVAdmission([cap], max_response_tokens=MAX)
    cold.add(_jobs(20))
    assert len(cold.admit()) == 3                     # prompt + max length each, as the paper reserves
    paper = KVAdmission([cap], max_response_tokens=MAX, reserve="max", lengths=_warm([50] * 200))
    paper.add(_jobs(20))
    assert len(paper.admit()) == 3                    # the paper's rule ignores what it has seen
    warm = KVAdmission([cap], max_response_tokens=MAX, lengths=_warm([50] * 200))
    warm.add(_jobs(20))
    admitted = warm.admit()
    assert len(admitted) == 20                        # 20 x (100 + 50) fits 3,300 tokens; the rule let 3 in
    assert warm.projected(0, sigmas=warm.admit_sigmas) <= cap


def test_holds_the_young_at_turn_boundaries_and_resumes_oldest_first():
    cap = 3 * (P + MAX)
    pol = KVAdmission([cap], max_response_tokens=MAX, lengths=_warm([100] * 300))
    pol.add(_jobs(12))
    tids = [j.tid for j, _ in pol.admit()]
    assert len(tids) == 12
    for t in tids:                                    # every one wrote far more than the stage's lengths
        pol.end_turn(t, P + 250)
    assert pol.projected(0) > cap
    assert pol.begin_turn(tids[0], P + 270)           # the oldest always goes on
    assert not pol.begin_turn(tids[5], P + 270)       # a younger one waits, its KV kept
    assert not pol.begin_turn(tids[6], P + 270)
    assert pol.stats["holds"] == 2 and pol.admit() == []     # nothing new while some are held
    assert pol.resumable() == []
    for t in tids[:5] + tids[7:]:
        pol.release(t, P + 300)
    assert pol.resumable() == [tids[5], tids[6]]      # room again: held ones resume, oldest first
    assert pol.resumable() == []


def test_engine_clock_from_turn_ends_grows_the_decoding_ones():
    pol = KVAdmission([10 ** 6], max_response_tokens=MAX)
    pol.add(_jobs(3))
    a, b, c = (j.tid for j, _ in pol.admit())
    pol.end_turn(a, P + 40)                           # a generated 40 tokens: the engine ran >= 40 steps
    assert pol.length(b) == pol.length(c) == P + 40   # b and c decoded alongside
    assert pol.length(a) == P + 40                    # a waits for its tool: it does not grow
    assert pol.begin_turn(a, P + 60)
    pol.end_turn(b, P + 100)                          # clock 100: a decoded 60 steps since it resumed at 40
    assert pol.length(a) == P + 60 + 60 and pol.length(c) == P + 100


def test_slot_engines_admit_whole_slots_and_route_to_the_least_loaded():
    pol = KVAdmission([4 * 2048, 3 * 2048], [2048, 2048], max_response_tokens=MAX, lengths=_warm([10] * 100))
    pol.add(_jobs(10))
    got = pol.admit()
    assert [e for _, e in got] == [0, 1, 0, 1, 0, 1, 0]      # a slot each, whatever the lengths; least work first
    pol.release(got[0][0].tid, P + 10)
    assert [e for _, e in pol.admit()] == [0]


def test_routes_to_the_engine_with_the_least_work_left():
    pol = KVAdmission([10 ** 6] * 2, max_response_tokens=MAX, lengths=_warm(range(0, MAX, 5)))
    pol.add(_jobs(2))
    (a, ea), (b, eb) = pol.admit()
    assert (ea, eb) == (0, 1)
    pol.end_turn(a.tid, P + 50)           # engine 0's trajectory: most of its length still to come
    pol.end_turn(b.tid, P + 900)          # engine 1's: near the maximum
    assert pol.remaining_work(0) > pol.remaining_work(1)
    pol.add(_jobs(1, start=2))
    assert [e for _, e in pol.admit()] == [1]


def test_group_affinity_keeps_a_group_on_one_engine_and_steals_at_the_end():
    pol = KVAdmission([3 * (P + MAX)] * 2, max_response_tokens=MAX, group_affinity=True)
    pol.add(_jobs(8, group_size=4))
    first = pol.admit()
    assert [(j.group, e) for j, e in first] == [(0, 0), (0, 0), (0, 0), (1, 1), (1, 1), (1, 1)]
    pol.release(first[3][0].tid, P + 10)                 # engine 1 has room; group 1's last sample goes there
    assert [(j.tid, e) for j, e in pol.admit()] == [(7, 1)]
    pol.release(first[4][0].tid, P + 10)                 # no new group left: engine 1 takes group 0's last one
    assert [(j.tid, e) for j, e in pol.admit()] == [(3, 1)] and pol.stats["steals"] == 1
    spread = KVAdmission([3 * (P + MAX)] * 2, max_response_tokens=MAX)
    spread.add(_jobs(4, group_size=4))
    assert [e for _, e in spread.admit()] == [0, 1, 0, 1]    # default: samples routed on their own


def test_static_admits_everything_in_contiguous_chunks():
    pol = StaticAdmission(3)
    pol.add(_jobs(7))
    assert [e for _, e in pol.admit()] == static_assignment(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert pol.admit() == [] and pol.begin_turn(0, 10)


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="no engine holds"):
        KVAdmission([500], max_response_tokens=MAX).add(_jobs(1))
    with pytest.raises(ValueError, match="unknown reserve 'p90'"):
        KVAdmission([5000], max_response_tokens=MAX, reserve="p90")
    with pytest.raises(ValueError, match="one LengthModel per stage"):
        KVAdmission([5000], max_response_tokens=MAX, lengths=LengthModel(2 * MAX))
    with pytest.raises(ValueError, match="admit_sigmas must be >= 0"):
        KVAdmission([5000], max_response_tokens=MAX, admit_sigmas=-1.0)
    with pytest.raises(ValueError, match="positive KV capacity"):
        KVAdmission([0], max_response_tokens=MAX)


@settings(max_examples=60, deadline=None)
@given(caps=st.lists(st.integers(P + MAX, 8 * (P + MAX)), min_size=1, max_size=3),
       slots=st.booleans(), warm=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["admit", "end", "begin", "release"]), st.integers(0, 10 ** 6),
                              st.integers(0, MAX)), max_size=120))
def test_invariants_under_random_events(caps, slots, warm, ops):
    """Admission never passes an engine's capacity at its own projection (slots: never more sequences
    than slots), a held trajectory is never the oldest on its engine, and releasing everything lets
    every queued trajectory in."""
    per = [1 + MAX + P] * len(caps) if slots else None
    pol = KVAdmission(caps, per, max_response_tokens=MAX, lengths=_warm(range(0, MAX, 7)) if warm else None)
    pol.add(_jobs(40))
    live: dict[int, int] = {}          # tid -> current length
    waiting_tool: set[int] = set()
    held: set[int] = set()

    def check(admitted):
        for job, e in admitted:
            live[job.tid] = P
        engines = {e for _, e in admitted}
        for e in engines:
            if slots:
                assert len(pol._ages[e]) * per[e] <= caps[e]
            else:
                assert pol.projected(e, sigmas=pol.admit_sigmas) <= caps[e] + 1e-6
        for e, runs in enumerate(pol._ages):
            assert not (runs and runs[0].held)

    for op, pick, grow in ops:
        if op == "admit" or not live:
            check(pol.admit())
            continue
        tids = sorted(live)
        tid = tids[pick % len(tids)]
        if op == "end" and tid not in waiting_tool and tid not in held:
            live[tid] = min(live[tid] + grow, P + MAX)
            pol.end_turn(tid, live[tid])
            waiting_tool.add(tid)
        elif op == "begin" and tid in waiting_tool:
            waiting_tool.discard(tid)
            if not pol.begin_turn(tid, live[tid]):
                held.add(tid)
        elif op == "release" and tid not in held:
            pol.release(tid, live.pop(tid))
            waiting_tool.discard(tid)
        for t in pol.resumable():
            held.remove(t)
        check([])
    for _ in range(200):                 # drain: finish whatever runs, resume what is held
        check(pol.admit())
        for t in pol.resumable():
            held.remove(t)
        running = [t for t in live if t not in held]
        if not running:
            break
        for t in running:
            pol.release(t, live.pop(t))
            waiting_tool.discard(t)
    assert not live and not held and pol.admit() == []
