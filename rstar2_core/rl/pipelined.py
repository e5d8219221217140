"""Asynchronous RL steps with a staleness bound (`rl.max_staleness` = k >= 1): the engines roll the next
batches out while the trainer updates.

A producer rolls the planned batches out in step order (`rollout_and_grade`) and launches step s's batch
only once the trainer has taken step s - 1 - k; a consumer trains them in order, each update in a worker
thread (`update_from` without the push). Invariant: weights reach the engines only while no batch is in
flight and no update runs (`rt.sync_weights` under the trainer lock), so every token of a batch comes from
one policy version and a batch's staleness is in [0, k] by construction (none is dropped for age). An error
on either side stops the other and the stage raises.

See docs/rl.md, "Asynchronous RL (`rl.max_staleness`)".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from rstar2_core.rl.data import RLProblem
from rstar2_core.rl.step import RolledOut, StepOutcome
from rstar2_core.runtime.protocol import StageRuntime, WeightSyncReport


@dataclass(frozen=True)
class StepPlan:
    """One step of the stage as planned before it runs: its number (1-based in the stage), its batch and
    the data cursor after that batch."""

    step: int
    batch: tuple[RLProblem, ...]
    cursor_after: int


async def run_pipelined(rt: StageRuntime, plans: Sequence[StepPlan], *, max_staleness: int, start_version: int,
                        rollout: Callable[[StepPlan, int], Awaitable[RolledOut]],
                        update: Callable[[StepPlan, RolledOut, int], StepOutcome],
                        before_step: Callable[[StepPlan], Awaitable[None]],
                        after_step: Callable[[StepPlan, StepOutcome], None]) -> None:
    """Run `plans` with at most `max_staleness` steps between the engines' weights and the trainer's (see
    the module docstring). `start_version`: the step whose weights both hold at the start (the resumed
    checkpoint's); `rollout(plan, version)` rolls a plan's batch out with weights of that version;
    `update(plan, rolled, staleness)` is the step's update (in a worker thread; it publishes);
    `before_step(plan)` runs first in each step (fault injection); `after_step(plan, outcome)` records it,
    with the `sync/...` metrics of the pushes since the previous step added."""
    if max_staleness < 1:
        raise ValueError(f"run_pipelined needs max_staleness >= 1, got {max_staleness}")
    queue: asyncio.Queue[RolledOut] = asyncio.Queue()
    progress = asyncio.Condition()
    trainer_lock = asyncio.Lock()        # held by an update and by a push: a push never reads half-stepped weights
    state = {"trained": start_version, "engines": start_version, "url": None, "rolling": False, "launched": 0}
    pushes: list[WeightSyncReport] = []

    async def push() -> None:
        """The trainer's weights to the engines; the caller holds `trainer_lock` and no batch is in flight."""
        version = state["trained"]
        pushes.append(await asyncio.to_thread(rt.sync_weights, state["url"]))
        state["engines"] = version

    async def produce() -> None:
        for plan in plans:
            oldest = plan.step - 1 - max_staleness            # the oldest weights this batch may be sampled by
            async with progress:
                await progress.wait_for(lambda oldest=oldest: state["trained"] >= oldest)
            # newer weights go out now if the bound needs them (waiting for a running update) or if no update
            # runs; otherwise the batch starts at once with the engines' weights, still within the bound
            if state["engines"] < oldest or (state["trained"] > state["engines"] and not trainer_lock.locked()):
                async with trainer_lock:
                    if state["trained"] > state["engines"]:
                        await push()
            state["rolling"], state["launched"] = True, state["launched"] + 1
            try:
                rolled = await rollout(plan, state["engines"])
            finally:
                state["rolling"] = False
            if state["trained"] > state["engines"] and not trainer_lock.locked():
                async with trainer_lock:     # the engines are idle and no update runs: push before the next launch
                    if state["trained"] > state["engines"]:
                        await push()
            await queue.put(rolled)

    producer = asyncio.create_task(produce(), name="rl-rollout-producer")
    try:
        for plan in plans:
            await before_step(plan)
            rolled = await _next(queue, producer)
            staleness = plan.step - 1 - rolled.policy_version
            if not 0 <= staleness <= max_staleness:      # the producer's gate makes this impossible
                raise RuntimeError(f"step {plan.step} got a batch of policy version {rolled.policy_version}: "
                                   f"staleness {staleness} outside [0, {max_staleness}]")
            async with trainer_lock:
                outcome = await asyncio.to_thread(update, plan, rolled, staleness)
                state["trained"], state["url"] = plan.step, outcome.checkpoint_url or state["url"]
                if not state["rolling"] and state["launched"] < len(plans):
                    await push()        # the engines are idle: the next batch starts from these weights
            outcome.metrics.update(_push_metrics(pushes))
            pushes.clear()
            async with progress:
                progress.notify_all()
            after_step(plan, outcome)
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


def _push_metrics(pushes: Sequence[WeightSyncReport]) -> dict[str, float]:
    """`sync/...` of the weight pushes since the previous step (seconds and bytes summed)."""
    if not pushes:
        return {}
    return {"sync/seconds": sum(r.seconds for r in pushes), "sync/bytes": float(sum(r.bytes for r in pushes)),
            "sync/engine_max_s": max(max(r.engine_seconds, default=0.0) for r in pushes)}


async def _next(queue: asyncio.Queue[RolledOut], producer: asyncio.Task) -> RolledOut:
    """The next rolled-out batch, or the producer's error if it stopped before delivering it."""
    if queue.empty() and not producer.done():
        get = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
    if not queue.empty():
        return queue.get_nowait()
    if producer.exception() is not None:
        raise producer.exception()
    raise RuntimeError("the rollout producer finished without the batch this step needs")
