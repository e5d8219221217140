"""Where a step's cluster time goes: device-seconds by role, idle fractions, sandbox load, tokens.

`step_usage_metrics` turns a runtime's cumulative busy counters (`StageRuntime.usage()`, read before
the rollout, after it, and after the update) and the step's phase times into `usage/...` metrics.
Invariant: busy time is what each engine and rank measures itself and held time is devices x phase
seconds, so `*_idle_frac` = 1 - busy / held means the same on both runtimes ("devices" are GPUs on a
GPU cluster, processes on a CPU-only one). Each metric: docs/runtime.md, "Where the cluster's time goes".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rstar2_core.runtime.protocol import RuntimeUsage


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _delta(a: Sequence[float], b: Sequence[float]) -> float:
    return float(sum(max(0.0, y - x) for x, y in zip(a, b)))


def step_usage_metrics(before: RuntimeUsage, after_rollout: RuntimeUsage, after_train: RuntimeUsage,
                       phases: dict[str, float], groups: Sequence[Sequence[Any]], kept: Sequence[Any],
                       n_trainer_ranks: int, train_start: RuntimeUsage | None = None) -> dict[str, float]:
    """`usage/...` of one step (see the module docstring). `train_start`: the counters when the update
    began (default `after_rollout`; the asynchronous loop rolls a batch out while an earlier one trains,
    so its two phases have their own snapshots)."""
    dev = max(1, after_rollout.devices_per_engine)
    n_eng = len(after_rollout.engine_busy_s)
    held_e = n_eng * dev * phases["rollout"]
    busy_e = _delta(before.engine_busy_s, after_rollout.engine_busy_s) * dev
    held_t = n_trainer_ranks * phases["train"]
    busy_t = _delta((train_start or after_rollout).trainer_busy_s, after_train.trainer_busy_s)
    calls = [c for g in groups for t in g for c in t.tool_calls if c.name is not None]   # those the sandbox ran
    lat = [c.duration_s for c in calls]
    cpu = [getattr(c, "cpu_s", None) for c in calls]
    generated = float(sum(t.n_generated_tokens for g in groups for t in g))
    trained = float(sum(t.n_generated_tokens for t in kept))
    out = {"usage/engine_device_s": held_e, "usage/engine_busy_s": busy_e,
           "usage/engine_idle_frac": 1.0 - min(1.0, busy_e / held_e) if held_e > 0 else 0.0,
           "usage/trainer_device_s": held_t, "usage/trainer_busy_s": busy_t,
           "usage/trainer_idle_frac": 1.0 - min(1.0, busy_t / held_t) if held_t > 0 else 0.0,
           "usage/sandbox_calls": float(len(calls)), "usage/sandbox_call_s": float(sum(lat)),
           "usage/sandbox_p50_ms": 1000.0 * _percentile(lat, 0.5),
           "usage/sandbox_p99_ms": 1000.0 * _percentile(lat, 0.99),
           "usage/sandbox_timeouts": float(sum(c.status == "timeout" for c in calls)),
           "usage/tokens_generated": generated, "usage/tokens_trained": trained,
           "usage/trained_share": trained / generated if generated else 0.0}
    measured = [x for x in cpu if x is not None]
    if measured:
        out["usage/sandbox_cpu_s"] = float(sum(measured))
    return out


TOTAL_KEYS = ("usage/engine_device_s", "usage/engine_busy_s", "usage/trainer_device_s", "usage/trainer_busy_s",
              "usage/sandbox_calls", "usage/sandbox_call_s", "usage/sandbox_cpu_s", "usage/sandbox_timeouts",
              "usage/tokens_generated",
              "usage/tokens_trained", "sync/seconds", "sync/bytes", "actor/skipped", "rollout/groups_kept",
              "rollout/groups_dropped_all_correct", "rollout/groups_dropped_all_wrong", "rollout/groups_dropped_too_few")
"""Per-step metrics the stage also sums over its steps (`total/<key>`), kept across resumes
(`total/actor/skipped`: steps that took no optimizer step; the stage refuses to end with every step so)."""
MAX_KEYS = ("actor/engine_logprob_gap_max",)
"""Per-step metrics the stage keeps the largest of (`total/<key>`): the worst engine/trainer log-prob gap of
any sampled token in the stage, what the recipe's summary shows per RL stage."""


def accumulate(totals: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """`totals` plus this step's summable metrics; the derived ratios of the sums as `total/...`."""
    out = dict(totals)
    for k in TOTAL_KEYS:
        if k in metrics:
            out[f"total/{k}"] = out.get(f"total/{k}", 0.0) + float(metrics[k])
    for k in MAX_KEYS:
        if k in metrics:
            out[f"total/{k}"] = max(out.get(f"total/{k}", 0.0), float(metrics[k]))
    he, be = out.get("total/usage/engine_device_s", 0.0), out.get("total/usage/engine_busy_s", 0.0)
    ht, bt = out.get("total/usage/trainer_device_s", 0.0), out.get("total/usage/trainer_busy_s", 0.0)
    out["total/usage/engine_idle_frac"] = 1.0 - min(1.0, be / he) if he else 0.0
    out["total/usage/trainer_idle_frac"] = 1.0 - min(1.0, bt / ht) if ht else 0.0
    gen = out.get("total/usage/tokens_generated", 0.0)
    out["total/usage/trained_share"] = out.get("total/usage/tokens_trained", 0.0) / gen if gen else 0.0
    return out
