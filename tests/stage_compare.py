"""What the RL-stage tests on Ray compare: the toy stage's sizes (`OVERRIDES`), the metrics that must be
equal between two runs of the same steps (`SAME`: rollouts, token counts, infrastructure counters), and
`assert_same_step` (those exactly; the loss and gradient norm within 1e-4)."""

from __future__ import annotations

import pytest

OVERRIDES = ["rl.prompts_per_step=3", "rl.grpo.group_size=4", "rl.grpo.oversample=2", "rl.stages.0.steps=3",
             "rl.stages.0.max_response_tokens=200", "rl.stages.0.max_turns=3", "rl.lr=1e-3", "rl.warmup_steps=2",
             "rl.micro_batch_size=8", "rl.checkpoint_every=1", "rl.keep_checkpoints=2", "rollout.max_batch_size=24",
             "sandbox.workers=2", "rl.temperature=0.6", "rollout.tool_response_timing=false"]
# (at 0.6 the toy policy's tool calls parse and run; without the wall-clock timing line the local and Ray
# runs see the same tool responses)
SAME = ("rollout/", "usage/tokens_", "usage/sandbox_calls", "usage/trained_share", "actor/tokens", "actor/skipped",
        "infra/", "data/")


def assert_same_step(a: dict, b: dict) -> None:
    for k, v in a.items():
        if k.startswith(SAME):
            assert b[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    for k in ("actor/pg_loss", "actor/grad_norm"):
        if k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
