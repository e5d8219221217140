"""The agent loop: tool calls go to the sandbox and come back masked, the sequence is token-in/token-out,
bad calls get error responses and the trajectory continues, limits end it with the right reason,
infrastructure failures are marked, and tool calls are dispatched without waiting for others."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_fakes import ScriptedEngine, ScriptedSandbox, call_text, scripted_turn

from rstar2_core.chat import render_tool_result
from rstar2_core.chat.tokens import ANSWER_CLOSE, TOOL_CALL_CLOSE, TOOL_NAME
from rstar2_core.rollout.agent import run_trajectory
from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.scheduler import rollout_groups
from rstar2_core.rollout.types import RolloutLimits, ToolCallRecord
from rstar2_core.sandbox.types import ExecutionResult, Status

PROBLEM = "What is 3 * 6?"
ANSWER = "So the result is 18.</reason>\n<answer>The answer is \\boxed{18}.</answer>"


def _char_ids(tokenizer, text):
    """A valid but non-canonical tokenization (one token per character): what a sampler may produce."""
    return [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]


def _run(engine, sandbox, chat, limits, problem=PROBLEM, seed=0):
    return asyncio.run(run_trajectory(engine, sandbox, chat, problem, limits, seed=seed))


def test_tool_turn_is_masked_and_training_sees_the_engine_tokens(chat, tokenizer):
    text1 = "Let me compute 3 * 6 with the tool.\n" + call_text("print(3 * 6)")
    ids1 = _char_ids(tokenizer, text1)
    assert ids1 != tokenizer.encode(text1, add_special_tokens=False)    # re-tokenizing would change them
    key = tuple(chat.prompt_ids(PROBLEM))
    engine = ScriptedEngine({key: [scripted_turn(tokenizer, text1, TOOL_CALL_CLOSE, ids=ids1),
                                   scripted_turn(tokenizer, ANSWER, ANSWER_CLOSE)]})
    sandbox = ScriptedSandbox()
    limits = RolloutLimits(max_turns=4, max_response_tokens=2000)
    traj = _run(engine, sandbox, chat, limits)

    assert [r.code for r, _ in sandbox.calls] == ["print(3 * 6)"]
    result = ExecutionResult(id="t0-0", status=Status.OK, stdout="ran 12 chars\n", stderr="", exit_code=0,
                             duration_s=0.01)
    tool_ids = chat.tool_response_ids([render_tool_result(result)])
    ids2 = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert engine.requests[1][0] == list(key) + ids1 + tool_ids           # next turn continues the same ids
    assert engine.requests[1][1].max_new_tokens == 2000 - len(ids1) - len(tool_ids)
    assert traj.prompt_ids == key
    assert traj.response_ids == tuple(ids1 + tool_ids + ids2)
    assert traj.loss_mask == tuple([1] * len(ids1) + [0] * len(tool_ids) + [1] * len(ids2))
    assert traj.logprobs == tuple([-0.5] * len(ids1) + [0.0] * len(tool_ids) + [-0.5] * len(ids2))
    assert traj.finish == "answer" and not traj.truncated and traj.n_turns == 2 and traj.n_answer_blocks == 1
    assert traj.tool_calls == (ToolCallRecord(TOOL_NAME, "ok", failed=False, infra=False, duration_s=0.01),)
    assert traj.response_text == tokenizer.decode(list(traj.response_ids), skip_special_tokens=False)
    assert "<tool_response>\nran 12 chars" in traj.response_text


def test_malformed_and_hallucinated_calls_answer_with_errors_and_continue(chat, tokenizer):
    turns = ["<tool_call>\n{not json}\n</tool_call>", call_text("print(1)", name="web_search"),
             call_text("raise ValueError(3)"), "done </tool_call>", ANSWER]
    key = tuple(chat.prompt_ids(PROBLEM))
    engine = ScriptedEngine({key: [scripted_turn(tokenizer, t, TOOL_CALL_CLOSE) for t in turns[:-1]]
                             + [scripted_turn(tokenizer, ANSWER, ANSWER_CLOSE)]})
    sandbox = ScriptedSandbox(verdict=lambda r: ExecutionResult(r.id, Status.ERROR, "", "ValueError: 3", 1, 0.02))
    traj = _run(engine, sandbox, chat, RolloutLimits(max_turns=8, max_response_tokens=4000))

    assert [c.status for c in traj.tool_calls] == ["invalid_json", "unknown_tool", "error", "invalid_json"]
    assert all(c.failed and not c.infra for c in traj.tool_calls)
    assert [r.code for r, _ in sandbox.calls] == ["raise ValueError(3)"]     # only the valid call ran
    seen = tokenizer.decode(engine.requests[1][0], skip_special_tokens=False)
    assert "<tool_response>\nTool call error (invalid_json)" in seen
    assert "there is no tool named" in tokenizer.decode(engine.requests[2][0], skip_special_tokens=False)
    assert "ValueError: 3" in tokenizer.decode(engine.requests[3][0], skip_special_tokens=False)
    assert traj.finish == "answer" and traj.n_turns == 5 and traj.n_failed_tool_calls == 4


def test_turn_and_token_limits_end_with_the_right_reason(chat, tokenizer):
    key = tuple(chat.prompt_ids(PROBLEM))
    call = scripted_turn(tokenizer, call_text("print(2)"), TOOL_CALL_CLOSE)

    # the last allowed turn ends with a tool call: not executed, finish max_turns
    sandbox = ScriptedSandbox()
    traj = _run(ScriptedEngine({key: [call] * 3}), sandbox, chat, RolloutLimits(max_turns=2, max_response_tokens=4000))
    assert (traj.finish, traj.n_turns, len(sandbox.calls), traj.truncated) == ("max_turns", 2, 1, True)

    # the tool response does not fit the budget: cut at the budget, finish max_tokens
    budget = len(call.token_ids) + 5
    traj = _run(ScriptedEngine({key: [call] * 3}), ScriptedSandbox(), chat,
                RolloutLimits(max_turns=5, max_response_tokens=budget))
    assert traj.finish == "max_tokens" and traj.truncated and len(traj.response_ids) == budget
    assert traj.loss_mask[-5:] == (0,) * 5 and traj.n_tool_calls == 1

    # the budget runs out while generating (the engine reports length)
    traj = _run(ScriptedEngine({key: [call] * 3}), ScriptedSandbox(), chat,
                RolloutLimits(max_turns=5, max_response_tokens=len(call.token_ids) - 3))
    assert traj.finish == "max_tokens" and traj.n_tool_calls == 0 and len(traj.response_ids) == len(call.token_ids) - 3

    # EOS (<|im_end|>) without an answer block
    eos = scripted_turn(tokenizer, "", ids=tokenizer.encode("I give up.", add_special_tokens=False) + [chat.im_end_id])
    traj = _run(ScriptedEngine({key: [eos]}), ScriptedSandbox(), chat, RolloutLimits(max_turns=5, max_response_tokens=99))
    assert traj.finish == "eos" and not traj.truncated and traj.n_answer_blocks == 0


def test_infrastructure_failures_are_marked_not_scored(chat, tokenizer):
    key = tuple(chat.prompt_ids(PROBLEM))
    call = scripted_turn(tokenizer, call_text("print(2)"), TOOL_CALL_CLOSE)
    answer = scripted_turn(tokenizer, ANSWER, ANSWER_CLOSE)
    limits = RolloutLimits(max_turns=5, max_response_tokens=4000)

    internal = ScriptedSandbox(verdict=lambda r: ExecutionResult(r.id, Status.INTERNAL, "", "worker lost", None, 0.0))
    traj = _run(ScriptedEngine({key: [call, answer]}), internal, chat, limits)
    assert traj.finish == "infra_error" and "worker lost" in traj.infra_error
    assert traj.tool_calls[0].infra and not traj.tool_calls[0].failed

    traj = _run(ScriptedEngine({key: [call, answer]}, fail_on_turn=1), ScriptedSandbox(), chat, limits)
    assert traj.finish == "infra_error" and traj.infra_error.startswith("engine: RuntimeError")
    assert traj.n_turns == 1 and traj.tool_calls[0].status == "ok"

    class Down:
        async def run(self, req):
            raise ConnectionError("sandbox unreachable")
    traj = _run(ScriptedEngine({key: [call, answer]}), Down(), chat, limits)
    assert traj.finish == "infra_error" and "unreachable" in traj.infra_error


def test_tool_calls_are_dispatched_without_waiting_for_other_trajectories(chat, tokenizer):
    fast, slow = "What is 1 + 1?", "What is 2 + 2?"
    kf, ks = tuple(chat.prompt_ids(fast)), tuple(chat.prompt_ids(slow))
    call = scripted_turn(tokenizer, call_text("print(2)"), TOOL_CALL_CLOSE)
    answer = scripted_turn(tokenizer, ANSWER, ANSWER_CLOSE)
    engine = ScriptedEngine({kf: [call, answer], ks: [call, answer]}, delay_s={kf: 0.01, ks: 0.5})
    sandbox = ScriptedSandbox()
    groups = asyncio.run(rollout_groups(engine, sandbox, chat, [fast, slow], n=1,
                                        limits=RolloutLimits(max_turns=3, max_response_tokens=4000), seed=0))
    assert [g[0].finish for g in groups] == ["answer", "answer"]
    slow_first_turn_end = dict(engine.log)[f"gen_end:{ks[-1]}:0"]
    first_call_at = sandbox.calls[0][1]
    assert first_call_at < slow_first_turn_end            # the fast one's tool ran while the slow one generated
    assert groups[1][0].gen_time_s >= 1.0                 # two turns of the slow engine's 0.5 s each


def test_real_engine_trajectory_keeps_engine_tokens_and_logprobs(chat, tokenizer, model):
    async def go():
        engine = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=1200)
        try:
            return await run_trajectory(engine, ScriptedSandbox(), chat, PROBLEM,
                                        RolloutLimits(max_turns=3, max_response_tokens=24, temperature=1.0), seed=3)
        finally:
            await engine.close()
    traj = asyncio.run(go())
    assert traj.n_generated_tokens >= 1 and len(traj.response_ids) <= 24
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    p = len(traj.prompt_ids)
    for i, (t, m, lp) in enumerate(zip(traj.response_ids, traj.loss_mask, traj.logprobs)):
        if m:
            assert lp == pytest.approx(logp[p + i - 1, t].item(), abs=1e-4)
    again = asyncio.run(go())
    assert again.response_ids == traj.response_ids                          # same seed, same trajectory


def test_real_sandbox_results_reach_the_model(chat, tokenizer):
    from rstar2_core.config import SandboxConfig
    from rstar2_core.sandbox import make_sandbox

    key = tuple(chat.prompt_ids(PROBLEM))
    engine = ScriptedEngine({key: [scripted_turn(tokenizer, call_text("print(6 * 7)"), TOOL_CALL_CLOSE),
                                   scripted_turn(tokenizer, call_text("print(1 / 0)"), TOOL_CALL_CLOSE),
                                   scripted_turn(tokenizer, ANSWER, ANSWER_CLOSE)]})

    async def go():
        async with make_sandbox(SandboxConfig(workers=1)) as sandbox:
            return await run_trajectory(engine, sandbox, chat, PROBLEM, RolloutLimits(4, 4000), seed=1)
    traj = asyncio.run(go())
    assert [(c.status, c.failed, c.infra) for c in traj.tool_calls] == [("ok", False, False), ("error", True, False)]
    assert "<tool_response>\n42\n" in tokenizer.decode(engine.requests[1][0], skip_special_tokens=False)
    assert "ZeroDivisionError" in tokenizer.decode(engine.requests[2][0], skip_special_tokens=False)
    assert traj.finish == "answer" and traj.tool_time_s > 0
