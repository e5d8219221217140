"""What the RL-stage tests on Ray compare: the toy stage's sizes (`OVERRIDES`), the metrics that must be
equal between two runs of the same steps (`SAME`: rollouts, token counts, infrastructure counters), and
`assert_same_step` (those exactly; the loss and gradient norm within 1e-4). `assert_same_steps` compares
two runs' steps with their rollout traces (tests/rollout_trace.py): what the design keeps exact always,
the rollout metrics exactly up to a near-tie in sampling (after which they are not comparable)."""

from __future__ import annotations

import warnings

import pytest
from rollout_trace import Divergence, first_divergence

OVERRIDES = ["rl.prompts_per_step=3", "rl.grpo.group_size=4", "rl.grpo.oversample=2", "rl.stages.0.steps=3",
             "rl.stages.0.max_response_tokens=200", "rl.stages.0.max_turns=3", "rl.lr=1e-3", "rl.warmup_steps=2",
             "rl.micro_batch_size=8", "rl.checkpoint_every=1", "rl.keep_checkpoints=2", "rollout.max_batch_size=24",
             "sandbox.workers=2", "rl.temperature=0.6", "rollout.tool_response_timing=false",
             "sandbox.timeout_s=30"]
# (at 0.6 the toy policy's tool calls parse and run; without the wall-clock timing line the local and Ray
# runs see the same tool responses; the toy's calls print a number, and a 30 s limit is one no call
# reaches on a loaded 2-core machine: the traces assert that no call timed out)
SAME = ("rollout/", "usage/tokens_", "usage/sandbox_calls", "usage/trained_share", "actor/tokens", "actor/skipped",
        "infra/", "data/")
DESIGN_EXACT = ("rollout/trajectories", "rollout/step", "data/cursor", "usage/sandbox_timeouts")
"""Per-step metrics equal in any two runs of the same steps, whatever they sampled."""


def assert_same_step(a: dict, b: dict) -> None:
    for k, v in a.items():
        if k.startswith(SAME):
            assert b[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    for k in ("actor/pg_loss", "actor/grad_norm"):
        if k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k


def assert_same_steps(a: list[tuple[int, dict]], b: list[tuple[int, dict]], trace_a: list[dict],
                      trace_b: list[dict]) -> Divergence | None:
    """Every step of run `b` against the same step of run `a`: the steps, their prompts and seeds, the
    trajectory counts, the data cursor, zero sandbox timeouts and zero infrastructure failures always;
    the rollout metrics exactly (`assert_same_step`) for the steps before the first near-tie. Returns that
    near-tie (None: the runs sampled the same tokens throughout, and the caller may compare weights)."""
    assert {s for s, _ in b} <= {r["step"] for r in trace_b} and {s for s, _ in a} <= {r["step"] for r in trace_a}, (
        "the rollout traces miss steps the runs logged (a pipelined stage, rl.max_staleness > 0, is not traced)")
    div = first_divergence(trace_a, trace_b)
    steps_a = dict(a)
    assert {s for s, _ in b} <= set(steps_a), (sorted(steps_a), [s for s, _ in b])
    for s, mb in b:
        ma = steps_a[s]
        for k in DESIGN_EXACT:
            assert ma.get(k) == mb.get(k), (s, k, ma.get(k), mb.get(k))
        assert ma.get("usage/sandbox_timeouts", 0) == 0, s
        assert ma.get("infra/failed", 0) == mb.get("infra/failed", 0) == 0, s
        if div is None or s < div.step:
            assert_same_step(ma, mb)
    if div is not None:
        warnings.warn(f"the runs' rollouts differ from step {div.step} on by a near-tie in sampling "
                      f"({div.description}); later steps compared on what the design keeps exact only")
    return div
