"""Synthetic task: deterministic under seed, correct answers (reference code executed), disjoint held-out
split with unseen phrasings, demonstrations built from real tool output with failing first calls."""

import re
from collections import Counter

import pytest

from rstar2_core.chat import ChatFormat, extract_answer, parse_tool_calls, render_tool_result
from rstar2_core.chat.tool_calls import ToolCall
from rstar2_core.config import SandboxConfig
from rstar2_core.data.synthetic import (
    FAMILIES,
    SFT_PHRASINGS,
    broken_code,
    execute_requests,
    generate_problems,
    reference_code,
    sft_demonstrations,
)
from rstar2_core.models.tokenizer import bootstrap_tokenizer
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status


def _execute(reqs):
    return execute_requests(reqs, SandboxConfig(timeout_s=10.0))


def test_same_seed_same_problems_other_seed_differs():
    a = generate_problems(3, 40, "rl")
    assert a == generate_problems(3, 40, "rl")
    assert [p.problem for p in a] != [p.problem for p in generate_problems(4, 40, "rl")]
    assert len({p.problem for p in a}) == 40 and len({p.id for p in a}) == 40
    assert Counter(p.family for p in a) == Counter({f.name: 40 // 7 + (i < 40 % 7) for i, f in enumerate(FAMILIES)})


def test_answers_match_executed_reference_code():
    probs = generate_problems(0, 2 * len(FAMILIES), "eval") + generate_problems(0, len(FAMILIES), "sft")
    results = _execute([ExecutionRequest(code=reference_code(p), id=p.id) for p in probs])
    for p, r in zip(probs, results):
        assert r.status is Status.OK, (p, r)
        assert r.stdout.strip() == p.answer, (p.problem, r.stdout, p.answer)
        assert p.answer.lstrip("-").isdigit()


def test_sieve_counts_equal_trial_division():
    from rstar2_core.data.synthetic import _count_primes, _is_prime

    def trial(n):
        return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    assert [n for n in range(-3, 10_050) if _is_prime(n)] == [n for n in range(-3, 10_050) if trial(n)]
    for a, b in ((2, 2), (1, 10), (120, 980), (900, 2400), (9_990, 10_020), (5, 4)):
        assert _count_primes(a, b) == sum(trial(n) for n in range(a, b + 1)), (a, b)


def test_eval_split_is_held_out():
    sft = generate_problems(0, 700, "sft")
    rl = generate_problems(0, 700, "rl")
    ev = generate_problems(0, 350, "eval")
    key = lambda p: (p.family, p.params)
    assert not {key(p) for p in ev} & ({key(p) for p in sft} | {key(p) for p in rl})
    assert not {p.problem for p in ev} & {p.problem for p in sft + rl}
    assert max(p.phrasing for p in sft) == SFT_PHRASINGS - 1
    unseen = [p for p in ev if p.phrasing >= SFT_PHRASINGS]
    assert 0.1 < len(unseen) / len(ev) < 0.5
    assert any(p.phrasing >= SFT_PHRASINGS for p in rl)
    with pytest.raises(ValueError, match="valid"):
        generate_problems(0, 1, "test")


def test_broken_code_fails_when_run():
    import random

    probs = generate_problems(1, 3 * len(FAMILIES), "sft")
    rng = random.Random(0)
    broken = [broken_code(reference_code(p), rng) for p in probs]
    results = _execute([ExecutionRequest(code=c, id=str(i)) for i, c in enumerate(broken)])
    assert all(r.status.is_failure for r in results), [(c, r.status) for c, r in zip(broken, results)]


def test_demonstrations_use_real_tool_output_and_render():
    rejected: dict[str, int] = {}
    demos = sft_demonstrations(0, 14, 0.5, execute=_execute, render=render_tool_result, rejected=rejected)
    assert len(demos) == 14 and not rejected
    assert sum(d.failed_first for d in demos) == 7
    chat = ChatFormat(bootstrap_tokenizer())
    for d in demos:
        texts = [t for t, _ in d.turns]
        calls = [c for t in texts[:-1] for c in parse_tool_calls(t)]
        assert all(isinstance(c, ToolCall) for c in calls) and len(calls) == 1 + d.failed_first
        responses = [r for _, rs in d.turns[:-1] for r in rs]
        assert responses[-1].splitlines()[0] == d.answer          # the executed program's stdout
        if d.failed_first:
            assert responses[0].startswith("Error") and "Error" in texts[1]
        assert extract_answer(texts[-1]) == d.answer
        ids, mask = chat.render_trajectory(d.problem, d.turn_lists())
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    again = sft_demonstrations(0, 14, 0.5, execute=_execute, render=render_tool_result)
    untimed = lambda ds: re.sub(r"execution time: [0-9.]+ s", "", repr(ds))
    assert untimed(again) == untimed(demos)


def test_direct_answer_demonstrations_come_on_top_of_the_same_tool_demonstrations():
    plain = sft_demonstrations(0, 40, 0.5, execute=_execute, render=render_tool_result)
    demos = sft_demonstrations(0, 40, 0.5, execute=_execute, render=render_tool_result, direct_share=0.2)
    direct = [d for d in demos if d.direct]
    assert len(demos) == 50 and len(direct) == 10 and all(d.direct for d in demos[40:])
    assert sum(d.failed_first for d in demos) == 20 and not any(d.failed_first for d in direct)
    untimed = lambda ds: re.sub(r"execution time: [0-9.]+ s", "", repr(ds))
    assert untimed(demos[:40]) == untimed(plain)          # the share does not change the tool demonstrations
    assert not {d.id for d in direct} & {d.id for d in demos[:40]}
    chat = ChatFormat(bootstrap_tokenizer())
    for d in direct:
        assert len(d.turns) == 1 and d.turns[0][1] is None and not parse_tool_calls(d.turns[0][0])
        assert extract_answer(d.turns[0][0]) == d.answer and d.mask_answer and d.to_json()["mask_answer"]
        _, mask = chat.render_trajectory(d.problem, d.turn_lists())
        assert 0 < sum(mask) < len(mask)
    assert not any(d.direct or d.mask_answer for d in plain) and sum(d.failed_first for d in plain) == 20
    for bad in (2.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="direct_share"):
            sft_demonstrations(0, 4, 0.0, execute=_execute, render=render_tool_result, direct_share=bad)


def test_signposted_failing_calls_open_with_their_own_reason():
    from rstar2_core.data.synthetic import CALL_REASON, HASTY_REASON

    demos = sft_demonstrations(0, 28, 0.5, execute=_execute, render=render_tool_result, signposted=True)
    plain = sft_demonstrations(0, 28, 0.5, execute=_execute, render=render_tool_result)
    assert sum(d.failed_first for d in demos) == 14
    for d, q in zip(demos, plain):
        first = d.turns[0][0]
        assert (HASTY_REASON in first) == d.failed_first and (CALL_REASON in first) != d.failed_first
        assert first.replace(HASTY_REASON, CALL_REASON) == q.turns[0][0]      # nothing else changes
        assert all(HASTY_REASON not in t for t, _ in d.turns[1:])


def test_wrong_reference_output_is_rejected_and_counted():
    def off_by_one(reqs):
        from dataclasses import replace

        out = _execute(reqs)
        return [replace(r, stdout=str(int(r.stdout) + 1) + "\n") if r.status is Status.OK else r for r in out]

    rejected: dict[str, int] = {}
    demos = sft_demonstrations(0, 7, 0.0, execute=off_by_one, render=render_tool_result, rejected=rejected)
    assert demos == [] and rejected == {"reference_code_wrong": 7}


def test_sandbox_internal_errors_drop_their_demonstrations_and_past_the_share_raise():
    from dataclasses import replace

    from rstar2_core.errors import InfraFailureShareExceeded

    def failing(share):
        def execute(reqs):
            out = [ExecutionResult(id=r.id, status=Status.OK, stdout="", stderr="", exit_code=0, duration_s=0.0)
                   for r in reqs]   # never run: every call below either fails or is replaced by the right output
            ok = {p.id: p.answer for p in generate_problems(0, 40, "sft")}
            bad = set(range(0, len(reqs), round(1 / share))) if share else set()
            return [replace(o, status=Status.INTERNAL, stderr="sandbox light template died twice") if i in bad
                    else replace(o, stdout=ok[o.id.split(":")[0]] + "\n") for i, o in enumerate(out)]
        return execute

    rejected: dict[str, int] = {}
    demos = sft_demonstrations(0, 40, 0.0, execute=failing(0.025), render=render_tool_result, rejected=rejected,
                               max_infra_share=0.05)
    assert rejected == {"sandbox_internal": 1} and len(demos) == 39   # counted apart from wrong reference code
    with pytest.raises(InfraFailureShareExceeded, match=r"2 of the 40 tool calls .* failed in the sandbox service "
                       r".*template died twice.*max_infra_failure_share = 0.01"):
        sft_demonstrations(0, 40, 0.0, execute=failing(0.05), render=render_tool_result, max_infra_share=0.01)


def test_demonstrations_run_on_the_local_service_whatever_backend_the_stages_use():
    # a recipe on the Ray runtime sets sandbox.backend="ray" for its RL stages; building the SFT data still
    # runs the reference programs here, on the local service
    p = generate_problems(0, 1, "sft")[0]
    [r] = execute_requests([ExecutionRequest(code=reference_code(p), id=p.id)],
                           SandboxConfig(timeout_s=10.0, backend="ray"))
    assert r.status is Status.OK and r.stdout.strip() == p.answer
