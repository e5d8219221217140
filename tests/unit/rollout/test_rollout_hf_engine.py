"""HFEngine: continuous batching is exact (same tokens as one-at-a-time and as `model.generate`),
logprobs match a separate forward pass, seeds make sampling independent of batch composition, stop
ids/strings/length end requests correctly, prefixes are reused (and a long shared one read once per decode
step), weights can be swapped."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_fakes import tiny_model

from rstar2_core import storage
from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.types import SamplingParams

PROMPTS = [[5, 17, 40, 41, 9], [100, 3], [7, 8, 9, 10, 11, 12, 13, 14], [250], [60, 61, 62, 63], [33, 34]]


def _run(coro):
    return asyncio.run(coro)


async def _staggered(engine, prompts, params_for, gap_s=0.005):
    async def one(i, p):
        await asyncio.sleep(gap_s * i)
        return await engine.generate(p, params_for(i))
    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await engine.close()


def _forward_logprobs(model, prompt, out_ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(out_ids)])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]


def test_continuous_batching_matches_one_at_a_time_and_generate(model, tokenizer):
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    # 3 slots for 6 requests arriving at different times: requests join and leave mid-batch
    batched = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=3, max_seq_len=64), PROMPTS,
                              lambda i: greedy))
    for k, (p, out) in enumerate(zip(PROMPTS, batched)):
        alone = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=1, max_seq_len=64), [p], lambda i: greedy))[0]
        assert out.token_ids == alone.token_ids
        if k in (0, 2):   # model.generate costs ~1.5 s a call here: two prompts suffice
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)
            assert out.token_ids == tuple(ref[0, len(p):].tolist())
        assert out.finish_reason == "length"
        assert out.logprobs == pytest.approx(_forward_logprobs(model, p, out.token_ids), abs=1e-4)


def test_sampled_logprobs_match_forward_and_seed_ignores_batch_composition(model, tokenizer):
    params = lambda i: SamplingParams(max_new_tokens=12, temperature=0.7, seed=1000 + i)
    crowd = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=64), PROMPTS, params))
    for i, (p, out) in enumerate(zip(PROMPTS, crowd)):
        alone = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64), [p],
                                lambda _, i=i: params(i)))[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(_forward_logprobs(model, p, out.token_ids, 0.7), abs=1e-4)
    other_seed = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=64), PROMPTS,
                                 lambda i: SamplingParams(max_new_tokens=12, temperature=0.7, seed=7 + i)))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in crowd]


def test_static_shapes_decode_gives_the_same_tokens(model, tokenizer):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    dyn = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=3, max_seq_len=48), PROMPTS, lambda i: greedy))
    static = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=3, max_seq_len=48, static_shapes=True),
                             PROMPTS, lambda i: greedy))
    assert [o.token_ids for o in dyn] == [o.token_ids for o in static]


def test_stop_token_stop_string_and_length(model, tokenizer):
    p = PROMPTS[0]
    free = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64), [p],
                           lambda i: SamplingParams(max_new_tokens=20, temperature=0.0)))[0].token_ids
    k = 6
    stop_id = free[k]
    first = free.index(stop_id)
    out = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64), [p],
                          lambda i: SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop_id,))))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop" and out.stop_string is None

    text = tokenizer.decode(list(free[8:11]), skip_special_tokens=False)
    expect = next(i for i in range(len(free)) if text in tokenizer.decode(list(free[: i + 1]),
                                                                          skip_special_tokens=False))
    out = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64), [p],
                          lambda i: SamplingParams(max_new_tokens=20, temperature=0.0, stop_strings=("@@", text))))[0]
    assert out.token_ids == free[: expect + 1] and out.finish_reason == "stop" and out.stop_string == text

    # the slot's room caps max_new_tokens: max_seq_len - 1 - prompt length
    out = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=12), [p],
                          lambda i: SamplingParams(max_new_tokens=100, temperature=0.0)))[0]
    assert out.token_ids == free[: 12 - 1 - len(p)] and out.finish_reason == "length"


def test_next_turn_reuses_the_cached_prefix(model, tokenizer):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def two_turns(engine):
        first = await engine.generate(PROMPTS[2], greedy)
        second = await engine.generate(PROMPTS[2] + list(first.token_ids) + [1, 2, 3], greedy)
        await engine.close()
        return first, second

    engine = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64)
    first, second = _run(two_turns(engine))
    assert engine.stats["reused_tokens"] == len(PROMPTS[2]) + len(first.token_ids) - 1
    fresh = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=64),
                            [PROMPTS[2] + list(first.token_ids) + [1, 2, 3]], lambda i: greedy))[0]
    assert second.token_ids == fresh.token_ids


def test_update_weights_from_state_dict_and_checkpoint(model, tokenizer, tmp_path):
    from safetensors.torch import save_file

    other = tiny_model(len(tokenizer), seed=1)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    want = other.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)[0, 2:].tolist()
    engine = HFEngine(tiny_model(len(tokenizer)), tokenizer, max_batch_size=2, max_seq_len=64)
    before = _run(_staggered(engine, [PROMPTS[1]], lambda i: greedy))[0]
    assert before.token_ids != tuple(want)

    engine = HFEngine(tiny_model(len(tokenizer)), tokenizer, max_batch_size=2, max_seq_len=64)
    engine.update_weights(other.state_dict())
    assert _run(_staggered(engine, [PROMPTS[1]], lambda i: greedy))[0].token_ids == tuple(want)

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(ckpt / "model.safetensors"))
    engine = HFEngine(tiny_model(len(tokenizer)), tokenizer, max_batch_size=2, max_seq_len=64)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        engine.update_weights(ckpt.as_uri())
    (ckpt / storage.COMPLETE_MARKER).write_text("")
    engine.update_weights(ckpt.as_uri())
    assert _run(_staggered(engine, [PROMPTS[1]], lambda i: greedy))[0].token_ids == tuple(want)
    with pytest.raises(ValueError, match="does not match the model"):
        engine.update_weights({"nope.weight": torch.zeros(1)})


def test_bad_requests_are_refused_with_the_fix(model, tokenizer):
    engine = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=16)

    async def go(prompt, n):
        try:
            return await engine.generate(prompt, SamplingParams(max_new_tokens=n))
        finally:
            await engine.close()

    with pytest.raises(ValueError, match="prompt_ids is empty"):
        _run(go([], 4))
    with pytest.raises(ValueError, match="raise max_seq_len"):
        _run(go(list(range(15)), 4))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        _run(go([1, 2], 0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        HFEngine(model, tokenizer, max_seq_len=10**6)
    assert HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64).kv_capacity_tokens() == 8 * 64
    assert HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64,
                    kv_capacity_tokens=200).kv_capacity_tokens() == 3 * 64


def test_shared_prompt_prefix_is_copied_not_prefilled(model, tokenizer):
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    shared = list(range(20, 40))
    prompts = [shared + [3, 4], shared + [5], shared + [3, 4]]
    engine = HFEngine(model, tokenizer, max_batch_size=3, max_seq_len=64)
    outs = _run(_staggered(engine, prompts, lambda i: greedy, gap_s=0.0))
    assert engine.stats["copied_tokens"] == len(shared) + (len(shared) + 1)   # third copies 21 from the first
    assert engine.stats["prefill_tokens"] == len(prompts[0]) + 1 + 1
    for p, out in zip(prompts, outs):
        alone = _run(_staggered(HFEngine(model, tokenizer, max_batch_size=1, max_seq_len=64), [p], lambda i: greedy))
        assert out.token_ids == alone[0].token_ids
        assert out.logprobs == pytest.approx(_forward_logprobs(model, p, out.token_ids), abs=1e-4)


async def _queued(engine, prompts, params_for):
    """Every request is queued before the engine's next admission (the loop waits on the lock it takes
    for each iteration), so which requests decode together does not depend on timing."""
    with engine._lock:
        tasks = [asyncio.ensure_future(engine.generate(p, params_for(i))) for i, p in enumerate(prompts)]
        await asyncio.sleep(0)                     # each generate() queues its request, then waits
    return await asyncio.gather(*tasks)


async def _all_queued(engine, prompts, params_for):
    """`_queued`, then the engine is closed."""
    try:
        return await _queued(engine, prompts, params_for)
    finally:
        await engine.close()


def test_rows_sharing_a_long_prompt_read_it_once_per_step_with_the_plain_steps_tokens(model, tokenizer):
    shared = [20 + i % 200 for i in range(100)]              # more than MIN_SHARED tokens: the block pays
    prompts = [shared + [3, 4], shared + [5], shared + [7, 8, 9], [60, 61, 62], shared[:70] + [1]]
    # 4 slots: the 3-token prompt, which shares nothing, decodes with three sharing ones (plain steps); when
    # it stops after 3 tokens the last prompt (70 shared tokens) takes its slot: steps that read the block
    new = lambda i: 3 if i == 3 else 14
    for params in (lambda i: SamplingParams(max_new_tokens=new(i), temperature=0.0),
                   lambda i: SamplingParams(max_new_tokens=new(i), temperature=0.8, seed=50 + i)):
        engine = HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=160)
        outs = _run(_all_queued(engine, prompts, params))
        plain = _run(_all_queued(HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=160, shared_prefix=False),
                                 prompts, params))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert 0 < engine.stats["shared_prefix_steps"] < engine.stats["decode_steps"]
        assert engine.stats["shared_prefix_unread_tokens"] > 0
        for i, (p, out) in enumerate(zip(prompts, outs)):
            temperature = params(i).temperature or 1.0
            assert out.logprobs == pytest.approx(_forward_logprobs(model, p, out.token_ids, temperature), abs=1e-4)


def test_a_weight_update_drops_the_prefix_block_and_the_next_round_rebuilds_it(model, tokenizer):
    shared = [20 + i % 200 for i in range(90)]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine = HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=160)

    prompts = [shared + [k] for k in (1, 2, 3)]

    async def rounds():
        first = await _queued(engine, prompts, lambda i: greedy)
        assert engine._block is not None and engine.stats["shared_prefix_steps"] > 0
        engine.update_weights(model.state_dict())
        assert engine._block is None
        steps = engine.stats["shared_prefix_steps"]
        second = await _queued(engine, prompts, lambda i: greedy)
        assert engine.stats["shared_prefix_steps"] > steps
        await engine.close()
        return first, second

    first, second = _run(rounds())
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    with pytest.raises(ValueError, match="shared_prefix=True needs dynamic shapes"):
        HFEngine(model, tokenizer, static_shapes=True, shared_prefix=True)
    assert not HFEngine(model, tokenizer, static_shapes=True).shared_prefix


def test_close_cancel_and_a_failing_step_leave_the_engine_consistent(tokenizer):
    from rstar2_core.rollout.hf_engine import EngineClosed

    model = tiny_model(len(tokenizer))
    engine = HFEngine(model, tokenizer, max_batch_size=2, max_seq_len=600)
    long = SamplingParams(max_new_tokens=500, temperature=0.0)
    real_forward = model.forward

    async def go():
        # a cancelled request frees its slot; the engine keeps serving
        task = asyncio.ensure_future(engine.generate([1, 2, 3], long))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await engine.generate([4, 5], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert len(ok.token_ids) == 3

        # a forward that raises fails the requests in that step, not the engine
        def broken(*a, **k):
            raise RuntimeError("device lost")
        model.forward = broken
        with pytest.raises(RuntimeError, match="device lost"):
            await engine.generate([6, 7], SamplingParams(max_new_tokens=3))
        model.forward = real_forward
        assert len((await engine.generate([6, 7], SamplingParams(max_new_tokens=3))).token_ids) == 3

        # closing fails what is still running, and refuses new requests
        task = asyncio.ensure_future(engine.generate([8, 9], long))
        await asyncio.sleep(0.05)
        await engine.close()
        with pytest.raises(EngineClosed):
            await task
        with pytest.raises(EngineClosed):
            await engine.generate([1], long)
        assert not engine._active and not engine._pending
    _run(go())
