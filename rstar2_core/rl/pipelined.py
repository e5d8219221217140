"""Asynchronous RL steps with a staleness bound (`rl.max_staleness` = k >= 1): the engines roll the next
batches out while the trainer updates.

    await run_pipelined(rt, plans, max_staleness=k, start_version=start_step, rollout=..., update=...,
                        before_step=..., after_step=...)

Two coroutines share one runtime (local: engines on their threads, the update in a worker thread; Ray:
engine actors and trainer shards):

- the **producer** rolls the planned batches out in step order, one batch at a time on every engine
  (`rollout_and_grade`). Before it launches step s's batch it waits until the trainer has taken step
  s - 1 - k (the bound);
- the **consumer** takes the batches in order and runs each step's update in a worker thread
  (`update_from` without the push), so the event loop keeps the rollouts going; the update publishes the
  step's checkpoint and the caller records the step (`after_step`).

Weights reach the engines only while no batch is in flight and no update runs (`rt.sync_weights` under
the trainer lock, so no optimizer step is half-applied): at the end of an update when the engines are
idle, when a rollout ends and no update runs, or before a launch when no update runs. A launch waits for
a running update only when the bound needs that update's weights; otherwise it starts with the weights
the engines have. So weights change between batches, never inside a trajectory, every token of a batch
comes from one policy version, and the rollouts overlap the updates instead of waiting for them.

Step s's trainer holds the weights after s - 1 updates; its batch was sampled by the weights of
`RolledOut.policy_version` updates, so its staleness (s - 1 - version, `rollout/staleness`) is in [0, k]
by construction: no batch is launched beyond the bound, so none is dropped for age. The update corrects
for it with truncated importance sampling against the engine's log-probs (`rl.tis_cap`, required).

Resume is lossless: a step checkpoint holds the data cursor after the batches *trained*, not after those
launched, and a batch's prompts are a function of the cursor (`rl.data.batch_indices`), so the batches
rolled out but not trained when a stage stops are derived again on resume and rolled out with the
checkpoint's weights: no prompt is skipped or trained twice.

Failures: an error of the producer (a dead engine, the infra-failure share) reaches the consumer when it
next waits for a batch; an error of the consumer (a dead trainer shard, stale weights) cancels the
producer; either way the stage raises and the runtime stops its actors.
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
