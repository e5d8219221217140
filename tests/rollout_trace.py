"""What two runs of the same RL steps sampled, and where they first differ.

Tests that compare two runs (a resumed stage with its straight run, the Ray runtime with the local one)
record every step's rollouts with `recording(sink, rl_seed)`, then call `first_divergence(a, b)`:

- the design keeps exact, and this asserts: the same steps with the same seeds and the same prompts in
  the same order, and no tool call that hit the sandbox's timeout (a call killed under load answers
  differently from the same call on a quiet machine, so its rollout is not comparable);
- the design cannot keep exact: sampled text after a near-tie. Requests sample by inverse CDF from
  per-request counter-based uniforms (rollout/sampling.py), so two runs draw the same token unless the
  logits differ across a CDF boundary; the engine's logits change in their last bits with the requests
  that share a decode batch, and the trainer's weights with the order of a reduction (ZeRO-3 across
  ranks). At the first step where two runs' rollouts differ, each differing trajectory must differ first
  at a token the model sampled, after an identical prefix (prompt, earlier tokens, tool responses), and
  only a few may (a near-tie is rare; a broken seed, cursor or tool differs everywhere at once).

`first_divergence` returns None when every shared step sampled the same tokens (then every rollout metric
must be equal), else the step whose rollouts first differ, with a description of the first difference.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

MAX_NEAR_TIES = 2
"""Trajectories of the first differing step allowed to differ (each at a sampled token after an identical
prefix); more than this is a bug, not a near-tie."""


def step_record(step: int, seed: int, rolled) -> dict:
    """A `rl.step.RolledOut` as plain JSON: per trajectory its tokens, loss mask and tool call statuses."""
    return {"step": step, "seed": seed, "problems": [p.id for p in rolled.batch],
            "groups": [[{"ids": list(t.response_ids), "mask": list(t.loss_mask),
                         "tools": [c.status for c in t.tool_calls]} for t in g] for g in rolled.groups]}


@contextlib.contextmanager
def recording(sink: list, rl_seed: int, max_step: int = 1000):
    """Append a `step_record` to `sink` for every step `rl_step` rolls out (synchronous stages:
    `rl.max_staleness = 0`) while the block runs."""
    from rstar2_core.rl import step as step_mod
    from rstar2_core.rl.stage import step_seed

    steps = {step_seed(rl_seed, s): s for s in range(1, max_step + 1)}
    real = step_mod.rollout_and_grade

    async def traced(*args, seed: int, **kw):
        rolled = await real(*args, seed=seed, **kw)
        sink.append(step_record(steps.get(seed, -1), seed, rolled))
        return rolled

    step_mod.rollout_and_grade = traced
    try:
        yield sink
    finally:
        step_mod.rollout_and_grade = real


@dataclass(frozen=True)
class Divergence:
    step: int
    description: str


def _first_diff(x: dict, y: dict) -> str | None:
    """None if the trajectories are equal; 'sampled: ...' if they first differ at a token both sampled;
    else what else differs (a tool response, the length)."""
    if x == y:
        return None
    n = next((i for i, (a, b) in enumerate(zip(x["ids"], y["ids"])) if a != b), min(len(x["ids"]), len(y["ids"])))
    where = (f"token {n} ({x['ids'][n] if n < len(x['ids']) else 'end'} vs {y['ids'][n] if n < len(y['ids']) else 'end'})"
             f" after {n} identical tokens; tool calls {x['tools']} vs {y['tools']}")
    if n < len(x["ids"]) and n < len(y["ids"]) and x["mask"][n] == y["mask"][n] == 1 and x["mask"][:n] == y["mask"][:n]:
        return "sampled " + where
    if x["ids"] == y["ids"]:
        return f"tool status: calls {x['tools']} vs {y['tools']} with the same tokens"
    kind = "tool response" if n < min(len(x["mask"]), len(y["mask"])) and not (x["mask"][n] and y["mask"][n]) \
        else "length"
    return f"{kind} {where}"


def first_divergence(a: list[dict], b: list[dict]) -> Divergence | None:
    """Compare the steps of `b` with the same steps of `a` (every step of `b` must be in `a`; a step `b`
    rolled out twice, a retry's, counts with its last record); see the module docstring for what is
    asserted and what is returned."""
    by_step = {r["step"]: r for r in a}
    for r in a + b:
        timed_out = [(r["step"], gi, ti) for gi, g in enumerate(r["groups"]) for ti, t in enumerate(g)
                     if "timeout" in t["tools"]]
        assert not timed_out, (f"tool calls hit the sandbox timeout at (step, group, rollout) {timed_out}: "
                               "rollouts of a loaded machine are not comparable; raise sandbox.timeout_s")
    latest = {r["step"]: r for r in b}      # a step rolled out again by a retry: its last attempt counts
    for rb in latest.values():              # what the design keeps exact, for every step first
        ra = by_step.get(rb["step"])
        assert ra is not None, f"step {rb['step']} was not rolled out by the run compared with"
        assert (ra["seed"], ra["problems"]) == (rb["seed"], rb["problems"]), f"step {rb['step']}: seed or prompts differ"
        assert [len(g) for g in ra["groups"]] == [len(g) for g in rb["groups"]], f"step {rb['step']}: group sizes"
    for step in sorted(latest):
        ra, rb = by_step[step], latest[step]
        diffs = [(gi, ti, d) for gi, (ga, gb) in enumerate(zip(ra["groups"], rb["groups"]))
                 for ti, (x, y) in enumerate(zip(ga, gb)) if (d := _first_diff(x, y)) is not None]
        if not diffs:
            continue
        text = "; ".join(f"problem {ra['problems'][gi]} rollout {ti}: {d}" for gi, ti, d in diffs)
        assert all(d.startswith("sampled ") for _, _, d in diffs) and len(diffs) <= MAX_NEAR_TIES, (
            f"step {step}: {len(diffs)} rollouts differ, not a near-tie: {text}")
        return Divergence(step, text)
    return None


def trace_lines(records: list[dict]) -> list[str]:
    """The records as JSON lines `{"trace": record}` (how a driver subprocess hands them to its test)."""
    return [json.dumps({"trace": r}) for r in records]
