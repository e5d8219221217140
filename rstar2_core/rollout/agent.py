"""The multi-turn agent loop: one trajectory = generate, call the Python tool, read its output, repeat.

    traj = await run_trajectory(engine, sandbox, ChatFormat(tokenizer), problem, limits, seed=7)

A trajectory's tool calls go to the sandbox from its own coroutine the moment its turn ends, so it
never waits for other trajectories. Invariant: token-in/token-out: the sequence is exactly the ids the
engine produced plus the tool-response ids (loss_mask 0), never re-tokenized text. Malformed calls get
their error text as the tool response; sandbox failures finish the trajectory as `infra_error`, while
an `InfraError` from the engine (its actor died) is the step's failure and propagates.
See docs/rollout.md, "The agent loop (`run_trajectory`)".
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rstar2_core.chat import (
    ToolCall,
    ToolCallError,
    count_answer_blocks,
    parse_tool_calls,
    render_tool_result,
)
from rstar2_core.chat.tokens import ANSWER_CLOSE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from rstar2_core.errors import InfraError
from rstar2_core.rollout.types import (
    Engine,
    GenerationOutput,
    RolloutLimits,
    SamplingParams,
    ToolCallRecord,
    Trajectory,
)
from rstar2_core.sandbox.types import ExecutionRequest, ExecutionResult

_ORPHAN_CLOSE = ToolCallError(
    "invalid_json", f"Tool call error (invalid_json): {TOOL_CALL_CLOSE} without a {TOOL_CALL_OPEN} before it. "
                    f"Open the call with {TOOL_CALL_OPEN} and put one JSON object inside.")


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Seed of one turn's generation, derived from the trajectory seed (None stays random)."""
    return None if seed is None else (seed * 1_000_003 + turn) % (1 << 63)


class _Builder:
    """The growing response of one trajectory (flat, aligned per token)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turn_texts: list[str] = []
        self.calls: list[ToolCallRecord] = []

    def add_generated(self, out: GenerationOutput) -> None:
        self.ids += out.token_ids
        self.loss_mask += [1] * len(out.token_ids)
        self.logprobs += out.logprobs

    def add_tool(self, ids: list[int]) -> None:
        self.ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


async def _execute(sandbox: Any, items: list[ToolCall | ToolCallError], tag: str
                   ) -> list[ExecutionResult | ToolCallError]:
    """Run every well-formed call concurrently; parse errors pass through as their own result."""
    async def one(k: int, item: ToolCall | ToolCallError) -> ExecutionResult | ToolCallError:
        if isinstance(item, ToolCallError):
            return item
        return await sandbox.run(ExecutionRequest(code=item.code, stdin=item.stdin, id=f"{tag}-{k}"))
    return list(await asyncio.gather(*(one(k, it) for k, it in enumerate(items))))


def _record(item: ToolCall | ToolCallError, result: ExecutionResult | ToolCallError) -> ToolCallRecord:
    if isinstance(result, ToolCallError):
        return ToolCallRecord(name=None, status=result.kind, failed=True)
    return ToolCallRecord(name=item.name, status=result.status.value, failed=result.status.is_failure,
                          infra=result.status.is_infra, duration_s=result.duration_s, cpu_s=result.cpu_s)


async def run_trajectory(engine: Engine, sandbox: Any, chat: Any, problem: str, limits: RolloutLimits,
                         seed: int | None = None) -> Trajectory:
    """Roll out one trajectory for `problem` (see module docstring). Never raises for model behaviour;
    configuration errors (ValueError/TypeError from the engine) propagate."""
    prompt = list(chat.prompt_ids(problem))
    b = _Builder()
    gen_s = tool_s = 0.0
    finish, infra = None, None
    for turn in range(limits.max_turns):
        remaining = limits.max_response_tokens - len(b.ids)
        if remaining < 1:
            finish = "max_tokens"
            break
        params = SamplingParams(max_new_tokens=remaining, temperature=limits.temperature, top_p=limits.top_p,
                                stop_token_ids=tuple(chat.eos_token_ids), stop_strings=tuple(chat.stop_strings),
                                seed=turn_seed(seed, turn))
        t0 = time.perf_counter()
        try:
            out = await engine.generate(prompt + b.ids, params)
        except (ValueError, TypeError, InfraError):
            raise   # a config error, or a dead engine actor: the step cannot go on
        except Exception as e:   # noqa: BLE001 - a failed request is marked, the trainer excludes it
            finish, infra = "infra_error", f"engine: {type(e).__name__}: {e}"
            break
        finally:
            gen_s += time.perf_counter() - t0
        if out.finish_reason == "abort":
            finish, infra = "infra_error", "engine aborted the request"
            break
        b.add_generated(out)
        text = chat.tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
        b.turn_texts.append(text)
        if out.finish_reason == "length":
            finish = "max_tokens"
            break
        if out.stop_string == ANSWER_CLOSE:
            finish = "answer"
            break
        if out.stop_string != TOOL_CALL_CLOSE:
            finish = "eos"
            break
        if turn + 1 >= limits.max_turns:
            finish = "max_turns"
            break
        items = parse_tool_calls(text) or [_ORPHAN_CLOSE]
        t0 = time.perf_counter()
        try:
            results = await _execute(sandbox, items, tag=f"t{turn}")
        except Exception as e:   # noqa: BLE001 - the sandbox service failed, not the program
            finish, infra = "infra_error", f"sandbox: {type(e).__name__}: {e}"
            break
        finally:
            tool_s += time.perf_counter() - t0
        b.calls += [_record(i, r) for i, r in zip(items, results)]
        if any(c.infra for c in b.calls):
            bad = next(r for r in results if isinstance(r, ExecutionResult) and r.status.is_infra)
            finish, infra = "infra_error", f"sandbox internal: {bad.stderr[:200]}"
            break
        texts = [render_tool_result(r, limits.tool_head_chars, limits.tool_tail_chars, limits.tool_max_chars,
                                    limits.tool_timing)
                 for r in results]
        tool_ids = chat.tool_response_ids(texts)
        room = limits.max_response_tokens - len(b.ids)
        b.add_tool(tool_ids[:room])
        if len(tool_ids) >= room:
            finish = "max_tokens"
            break
    assert finish is not None
    return Trajectory(
        prompt_ids=tuple(prompt), response_ids=tuple(b.ids), loss_mask=tuple(b.loss_mask),
        logprobs=tuple(b.logprobs),
        response_text=chat.tokenizer.decode(b.ids, skip_special_tokens=False),
        tool_calls=tuple(b.calls), n_turns=len(b.turn_texts),
        n_answer_blocks=sum(count_answer_blocks(t) for t in b.turn_texts), finish=finish,
        truncated=finish in ("max_tokens", "max_turns"), infra_error=infra, gen_time_s=gen_s, tool_time_s=tool_s,
        meta={"seed": seed})
