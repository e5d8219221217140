"""The synthetic tool-use task: seeded integer-answer problems a tiny model cannot solve in its head,
in seven families with four phrasings each (the code a solver should run is one regular line), and the
SFT demonstrations built from them (`sft_demonstrations`: a real tool call, some failing first).

    from rstar2_core.data.synthetic import generate_problems
    generate_problems(seed=0, n=5, split="eval")

Invariant: the same (seed, n, split) gives the same problems, and no `eval` problem is an `sft` or
`rl` problem (eval draws from a reserved slice of the parameter space; `sft` never uses phrasing 3).
See docs/data-and-eval.md, "The synthetic task", and docs/models-and-sft.md, "Synthetic task".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import comb, factorial

from rstar2_core.chat.tokens import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    REASON_CLOSE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_NAME,
)
from rstar2_core.errors import InfraFailureShareExceeded
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult, Status

SPLITS = ("sft", "rl", "eval")
SFT_PHRASINGS = 3        # phrasings 0..SFT_PHRASINGS-1 appear in SFT; the rest are held out
_EVAL_SLICE = 8          # 1 in _EVAL_SLICE parameter tuples is reserved for the eval split


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    family: str
    phrasing: int
    params: tuple[int, ...] = field(default=(), compare=False)

    def to_json(self) -> dict:
        return {"id": self.id, "problem": self.problem, "answer": self.answer, "family": self.family,
                "phrasing": self.phrasing, "params": list(self.params)}


def _sieve(limit: int) -> bytearray:
    """is_prime[n] for 0 <= n <= limit (sieve of Eratosthenes)."""
    flags = bytearray([1]) * (limit + 1)
    flags[0:2] = b"\x00\x00"
    for d in range(2, int(limit ** 0.5) + 1):
        if flags[d]:
            flags[d * d:: d] = bytes(len(range(d * d, limit + 1, d)))
    return flags


_SIEVE_MAX = 10_000                                   # covers every number the families draw
_PRIME = _sieve(_SIEVE_MAX)
_PI = list(itertools.accumulate(_PRIME))              # _PI[n] = number of primes <= n


def _is_prime(n: int) -> bool:
    if 0 <= n <= _SIEVE_MAX:
        return bool(_PRIME[n])
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _count_primes(a: int, b: int) -> int:
    """Primes p with a <= p <= b."""
    if 1 <= a and b <= _SIEVE_MAX:
        return _PI[b] - _PI[a - 1] if b >= a else 0
    return sum(_is_prime(n) for n in range(a, b + 1))


def _num_divisors(n: int) -> int:
    r = int(n ** 0.5)
    return sum(2 for d in range(1, r + 1) if n % d == 0) - (r * r == n)


def _rand_prime(rng: random.Random, lo: int, hi: int) -> int:
    while True:
        p = rng.randint(lo, hi)
        if _is_prime(p):
            return p


@dataclass(frozen=True)
class _Family:
    name: str
    phrasings: tuple[str, ...]
    code: str
    sample: Callable[[random.Random], tuple[int, ...]]
    solve: Callable[..., int]


def _two_distinct(rng: random.Random) -> tuple[int, int, int]:
    a = rng.randint(2, 19)
    b = rng.choice([x for x in range(2, 20) if x != a and x % a and a % x])
    return rng.randint(100, 9999), a, b


def _binom_params(rng: random.Random) -> tuple[int, int, int]:
    n = rng.randint(12, 150)
    return n, rng.randint(3, n - 3), _rand_prime(rng, 101, 9973)


def _fact_params(rng: random.Random) -> tuple[int, int]:
    n = rng.randint(10, 400)
    return n, _rand_prime(rng, n + 1, 9973)


def _prime_range(rng: random.Random) -> tuple[int, int]:
    a = rng.randint(2, 900)
    return a, a + rng.randint(50, 1500)


FAMILIES: tuple[_Family, ...] = (
    _Family("powmod",
            ("What is {0}^{1} mod {2}?",
             "Find the remainder when {0}^{1} is divided by {2}.",
             "Compute {0} to the power {1} modulo {2}.",
             "What remainder does {0}^{1} leave on division by {2}?"),
            "print(pow({0}, {1}, {2}))",
            lambda r: (r.randint(2, 99), r.randint(20, 999), r.randint(7, 997)),
            lambda a, b, m: pow(a, b, m)),
    _Family("digitsum_pow",
            ("What is the sum of the digits of {0}^{1}?",
             "Find the digit sum of {0}^{1}.",
             "Add up all the digits of {0} raised to the power {1}.",
             "If you write out {0}^{1} in full, what do its digits sum to?"),
            "print(sum(int(c) for c in str({0} ** {1})))",
            lambda r: (r.randint(2, 40), r.randint(8, 80)),
            lambda a, b: sum(int(c) for c in str(a ** b))),
    _Family("count_primes",
            ("How many primes are there from {0} to {1}, inclusive?",
             "Count the prime numbers between {0} and {1} inclusive.",
             "How many integers n with {0} <= n <= {1} are prime?",
             "Find the number of primes p such that {0} <= p <= {1}."),
            "print(sum(all(n % d for d in range(2, int(n ** 0.5) + 1)) for n in range({0}, {1} + 1)))",
            _prime_range,
            _count_primes),
    _Family("count_divisors",
            ("How many positive divisors does {0} have?",
             "Count the positive divisors of {0}.",
             "Find the number of positive integers that divide {0}.",
             "How many divisors d > 0 does the number {0} have?"),
            "print(sum({0} % d == 0 for d in range(1, {0} + 1)))",
            lambda r: (r.randint(100, 99999),),
            lambda n: _num_divisors(n)),
    _Family("binom_mod",
            ("What is C({0}, {1}) mod {2}?",
             "Find the binomial coefficient {0} choose {1} modulo {2}.",
             "In how many ways can {1} items be chosen from {0}? Give the count mod {2}.",
             "What is the remainder of ({0} choose {1}) divided by {2}?"),
            "from math import comb; print(comb({0}, {1}) % {2})",
            _binom_params,
            lambda n, k, m: comb(n, k) % m),
    _Family("factorial_mod",
            ("What is {0}! mod {1}?",
             "Find the remainder when {0} factorial is divided by {1}.",
             "Compute {0}! modulo {1}.",
             "What remainder does the factorial of {0} leave on division by {1}?"),
            "from math import factorial; print(factorial({0}) % {1})",
            _fact_params,
            lambda n, m: factorial(n) % m),
    _Family("sum_multiples",
            ("What is the sum of all positive integers up to {0} that are divisible by {1} or {2}?",
             "Add up every integer from 1 to {0} that is a multiple of {1} or of {2}.",
             "Find the sum of the numbers in 1..{0} divisible by {1} or by {2}.",
             "Sum all integers i with 1 <= i <= {0} such that {1} divides i or {2} divides i."),
            "print(sum(i for i in range(1, {0} + 1) if i % {1} == 0 or i % {2} == 0))",
            _two_distinct,
            lambda n, a, b: sum(i for i in range(1, n + 1) if i % a == 0 or i % b == 0)),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}


def _reserved_for_eval(family: str, params: tuple[int, ...]) -> bool:
    h = hashlib.sha256(f"{family}:{params}".encode()).digest()
    return h[0] % _EVAL_SLICE == 0


def generate_problems(seed: int, n: int, split: str) -> list[Problem]:
    """`n` distinct problems of `split` (sft, rl, eval), the same for the same (seed, n, split);
    families round-robin, phrasing and numbers drawn from a per-split RNG."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"rstar2-synthetic:{seed}:{split}")
    n_phr = SFT_PHRASINGS if split == "sft" else None
    out: list[Problem] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    misses = 0
    while len(out) < n:
        fam = FAMILIES[len(out) % len(FAMILIES)]
        params = fam.sample(rng)
        key = (fam.name, params)
        if key in seen or _reserved_for_eval(*key) != (split == "eval"):
            misses += 1
            if misses > 200_000:          # the family's parameter space is (nearly) used up
                raise ValueError(f"cannot draw {n} distinct {split!r} problems: family {fam.name!r} ran out of "
                                 f"parameter tuples after {len(out)} problems; lower data.synthetic.n_{split}")
            continue
        misses = 0
        seen.add(key)
        phrasing = rng.randrange(n_phr or len(fam.phrasings))
        out.append(Problem(id=f"syn-{split}-{seed}-{len(out):06d}", problem=fam.phrasings[phrasing].format(*params),
                           answer=str(fam.solve(*params)), family=fam.name, phrasing=phrasing, params=params))
    return out


def reference_code(p: Problem) -> str:
    """One line of Python that prints the answer of `p`."""
    return FAMILY_BY_NAME[p.family].code.format(*p.params)


# ------------------------------------------------------------------------------ demonstrations
_TYPOS = (("print(", "pritn("), ("pow(", "power("), ("sum(", "summ("), ("comb(", "combo("),
          ("factorial(", "fact("), ("range(", "rnage("), ("str(", "string("))


def broken_code(code: str, rng: random.Random) -> str:
    """A plausible failing variant of `code`: a misspelt name (NameError/ImportError) or a missing
    closing parenthesis (SyntaxError)."""
    typos = [(a, b) for a, b in _TYPOS if a in code]
    if typos and rng.random() < 0.75:
        a, b = rng.choice(typos)
        return code.replace(a, b)
    return code[:-1]


def tool_call_text(code: str, stdin: str = "") -> str:
    body = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def answer_text(answer: str) -> str:
    return f"{ANSWER_OPEN}\nThe answer is \\boxed{{{answer}}}.\n{ANSWER_CLOSE}"


@dataclass(frozen=True)
class Demonstration:
    """An SFT conversation in the `ChatFormat.render_trajectory(problem, turns)` form: each turn is the
    assistant text and the tool response texts that follow it (None for the last turn). The first
    turn's text continues the prompt's opening `<reason>`; later turns open their own `<reason>`."""

    id: str
    problem: str
    answer: str
    family: str
    turns: tuple[tuple[str, tuple[str, ...] | None], ...]
    failed_first: bool
    direct: bool = False      # answered without calling the tool
    mask_answer: bool = False  # the boxed answer is excluded from the SFT loss

    def turn_lists(self) -> list[tuple[str, list[str] | None]]:
        """`turns` in the list form `ChatFormat.render_trajectory` takes."""
        return [(t, list(r) if r is not None else None) for t, r in self.turns]

    def to_json(self) -> dict:
        return {"id": self.id, "problem": self.problem, "answer": self.answer, "family": self.family,
                "failed_first": self.failed_first, "direct": self.direct, "mask_answer": self.mask_answer,
                "turns": [[t, list(r) if r is not None else None] for t, r in self.turns]}


def execute_requests(reqs: Sequence[ExecutionRequest], sandbox_cfg) -> list[ExecutionResult]:
    """Run `reqs` through the sandbox service (`make_sandbox(...).run_batch`): demonstrations show the
    tool output the agent loop would get, produced the way it would get it. Always the local service,
    in the data task's process, whatever `sandbox.backend` the RL stages use: these are the task's own
    reference programs, run once while the data is built, and the service and its limits are the same."""
    import asyncio

    from rstar2_core.sandbox import make_sandbox

    async def _run() -> list[ExecutionResult]:
        async with make_sandbox(sandbox_cfg.model_copy(update={"backend": "local"})) as sb:
            return list(await sb.run_batch(list(reqs)))

    return asyncio.run(_run())


def _plan(p: Problem, fail_first: bool, rng: random.Random) -> list[str]:
    code = reference_code(p)
    return [broken_code(code, rng), code] if fail_first else [code]


DIRECT_REASON = "I can answer this without the tool."
CALL_REASON = "Let me compute it with Python."
HASTY_REASON = "Let me try it quickly in Python."   # opens a failing first call when signposted


def demo_options(syn) -> dict:
    """The keyword options of `sft_demonstrations` from a `data.synthetic` config section."""
    return {"direct_share": syn.direct_answer_share, "signposted": syn.fail_first_signposted,
            "max_infra_share": syn.max_infra_failure_share}


def demonstration_turns(p: Problem, codes: Sequence[str], results: Sequence[ExecutionResult],
                        render: Callable[[ExecutionResult], str],
                        signposted: bool = False) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """The turns of a tool demonstration of `p`: one call per code (a failing first one read and fixed
    when there are two), each followed by its rendered result, then the answer. `results[i]` is what
    running `codes[i]` gave; `signposted`: a failing first call opens with `HASTY_REASON` instead of
    `CALL_REASON`. `bench/copy_probe.py` renders its probes through this too."""
    first = HASTY_REASON if signposted and len(codes) == 2 else CALL_REASON
    turns: list[tuple[str, tuple[str, ...] | None]] = [
        (f"\n{first}\n{REASON_CLOSE}\n{tool_call_text(codes[0])}", (render(results[0]),))]
    if len(codes) == 2:
        err = (results[0].stderr.strip().splitlines() or ["error"])[-1].split(":")[0]
        turns.append((f"<reason>\nThe code raised {err}; fix it.\n{REASON_CLOSE}\n{tool_call_text(codes[1])}",
                      (render(results[1]),)))
    turns.append((f"<reason>\nThe output is {p.answer}.\n{REASON_CLOSE}\n{answer_text(p.answer)}", None))
    return tuple(turns)


def sft_demonstrations(seed: int, n: int, fail_first_share: float, *,
                       execute: Callable[[Sequence[ExecutionRequest]], list[ExecutionResult]],
                       render: Callable[[ExecutionResult], str],
                       rejected: dict[str, int] | None = None, direct_share: float = 0.0,
                       signposted: bool = False, max_infra_share: float = 0.01) -> list[Demonstration]:
    """Up to `n` demonstrations over `generate_problems(seed, n, "sft")`; each tool response is the
    rendered result of actually running the code (`execute`, e.g. a sandbox's batch run; `render`,
    e.g. `chat.render_tool_result`). A demonstration is rejected (counted in `rejected[reason]`) when
    the correct call does not print the gold answer or a deliberately broken call does not fail, or
    (`sandbox_internal`) when one of its calls failed for infrastructure reasons (`Status.INTERNAL`);
    more of those than `max_infra_share` of all calls raises `InfraFailureShareExceeded` (retryable).
    `fail_first_share` of them first make a failing call and fix it; `signposted` opens those with
    `HASTY_REASON`.

    `direct_share`: *besides* the `n` tool demonstrations, direct ones that answer without calling the
    tool (as general instruction data does) make up this share of the result: round(n * s / (1 - s))
    of them, on problems of their own stream (the tool demonstrations are the same whatever the share),
    placed after the tool ones. Their boxed answer is marked `mask_answer` (excluded from the SFT loss,
    `sft.packing.encode_conversations`): the model learns the route and the format, not to guess
    numbers it cannot compute."""
    if not 0.0 <= fail_first_share <= 1.0:
        raise ValueError(f"fail_first_share={fail_first_share} must be in [0, 1]")
    if not 0.0 <= direct_share < 1.0:
        raise ValueError(f"direct_share={direct_share} must be in [0, 1)")
    rng = random.Random(f"rstar2-demos:{seed}")
    problems = generate_problems(seed, n, "sft")
    n_fail = round(fail_first_share * n)
    fail_ids = set(rng.sample(range(n), n_fail)) if n else set()
    plans = [_plan(p, i in fail_ids, rng) for i, p in enumerate(problems)]
    reqs = [ExecutionRequest(code=c, id=f"{p.id}:{j}") for p, codes in zip(problems, plans)
            for j, c in enumerate(codes)]
    results = {r.id: r for r in execute(reqs)}
    infra = sum(r.status.is_infra for r in results.values())
    if reqs and infra > max_infra_share * len(reqs):
        example = next(r for r in results.values() if r.status.is_infra)
        raise InfraFailureShareExceeded(
            f"{infra} of the {len(reqs)} tool calls of the SFT demonstrations failed in the sandbox service "
            f"(status internal; e.g. {example.stderr[:200]!r}), more than data.synthetic.max_infra_failure_share "
            f"= {max_infra_share}: the demonstrations would lack their tool turns. Check the sandbox "
            "(`rstar2 sandbox doctor`) and retry")
    counts = rejected if rejected is not None else {}
    out: list[Demonstration] = []
    for p, codes in zip(problems, plans):
        res = [results[f"{p.id}:{j}"] for j in range(len(codes))]
        final = res[-1]
        if any(r.status.is_infra for r in res):
            counts["sandbox_internal"] = counts.get("sandbox_internal", 0) + 1
            continue
        if final.status is not Status.OK or final.stdout.strip() != p.answer:
            counts["reference_code_wrong"] = counts.get("reference_code_wrong", 0) + 1
            continue
        if len(res) == 2 and not res[0].status.is_failure:
            counts["broken_call_did_not_fail"] = counts.get("broken_call_did_not_fail", 0) + 1
            continue
        turns = demonstration_turns(p, codes, res, render, signposted)
        out.append(Demonstration(id=p.id, problem=p.problem, answer=p.answer, family=p.family,
                                 turns=turns, failed_first=len(res) == 2))
    n_direct = round(n * direct_share / (1.0 - direct_share)) if direct_share else 0
    for p in generate_problems(seed + 7919, n_direct, "sft"):   # a stream of their own
        out.append(Demonstration(id=f"{p.id}-direct", problem=p.problem, answer=p.answer, family=p.family,
                                 turns=((f"\n{DIRECT_REASON}\n{REASON_CLOSE}\n{answer_text(p.answer)}", None),),
                                 failed_first=False, direct=True, mask_answer=True))
    return out
