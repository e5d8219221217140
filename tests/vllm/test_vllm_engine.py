"""VLLMEngine against the real vLLM (CPU build): token-in/token-out generation with the tool stop strings,
abort, the sampled tokens' log-probs against the trainer's, and weight updates that change what the
engine serves (state dict and checkpoint URI, the worker-extension path)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rstar2_core.rl.logprobs import sequence_logprobs
from rstar2_core.rollout.types import SamplingParams, Trajectory

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _generate(engine, prompts, params_list):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params_list)])
    return asyncio.run(go())


def _trainer_logprobs(model, chat, prompt, outs, temperature):
    trajs = [Trajectory(tuple(prompt), o.token_ids, (1,) * len(o.token_ids), o.logprobs, "", (), 1, 0, "eos", False)
             for o in outs]
    return sequence_logprobs(model, trajs, chat.tokenizer.pad_token_id, temperature)


def test_token_in_token_out_with_the_tool_stop_strings(vllm_engine, toy_model):
    _, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 3: what does the program print?")
    params = [SamplingParams(max_new_tokens=120, temperature=0.6, stop_token_ids=tuple(chat.eos_token_ids),
                             stop_strings=tuple(chat.stop_strings), seed=s) for s in range(8)]
    outs = _generate(vllm_engine, [prompt] * 8, params)
    stopped = [o for o in outs if o.finish_reason == "stop" and o.stop_string]
    assert stopped, "the toy policy writes a tool call: some samples must stop at </tool_call>"
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs) > 0 and all(lp <= 0.0 for lp in o.logprobs)
        assert o.finish_reason in ("stop", "length")
        text = chat.tokenizer.decode(list(o.token_ids))
        if o.stop_string:                      # the stop string is kept, so training sees every sampled token
            assert o.stop_string in chat.stop_strings and text.endswith(o.stop_string)
    # same seed, same tokens: a request is reproducible whatever shares its batch
    again = _generate(vllm_engine, [prompt], params[:1])[0]
    assert again.token_ids == outs[0].token_ids


def test_many_seeded_requests_with_long_prompts_at_once(vllm_engine):
    """More prompt tokens than one scheduler step takes (16 x 400 > 2,048): vLLM 0.32 on CPU crashes its
    engine core when a seeded request's prefill is split over steps, so the adapter prefills each prompt
    whole there (no chunked prefill). Every request completes and the engine keeps serving."""
    prompts = [[(7 * i + j) % 900 + 3 for j in range(400)] for i in range(16)]
    outs = _generate(vllm_engine, prompts, [SamplingParams(max_new_tokens=4, seed=i) for i in range(16)])
    assert all(len(o.token_ids) >= 1 for o in outs)


def test_a_cancelled_request_is_aborted_and_the_engine_keeps_serving(vllm_engine, toy_model, monkeypatch):
    """Cancelling `generate` while vLLM runs the request aborts it there (the rollout scheduler cancels
    requests it no longer needs); the engine then serves the next request as usual."""
    _, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 4: what does the program print?")
    core = vllm_engine._engine
    aborted: list = []
    abort = core.abort

    async def recording_abort(request_id, *args, **kwargs):
        aborted.append(request_id)
        return await abort(request_id, *args, **kwargs)

    monkeypatch.setattr(core, "abort", recording_abort)

    async def cancel_in_flight():
        for seed in range(20):                 # a sample that ends (EOS) before it is seen running is retried
            task = asyncio.ensure_future(vllm_engine.generate(prompt, SamplingParams(max_new_tokens=900, seed=seed)))
            while not task.done() and core.output_processor.get_num_unfinished_requests() == 0:
                await asyncio.sleep(0.001)
            if task.done():
                continue
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if aborted and core.output_processor.get_num_unfinished_requests() == 0:
                    return True
                await asyncio.sleep(0.01)
            return False
        pytest.fail("no request was ever seen in flight")
    assert asyncio.run(cancel_in_flight()), "vLLM still holds the cancelled request"
    assert aborted and all(a.startswith(aborted[-1].split("-")[0] + "-") for a in aborted)
    out = _generate(vllm_engine, [prompt], [SamplingParams(max_new_tokens=5, seed=2)])[0]
    assert 1 <= len(out.token_ids) <= 5 and out.finish_reason in ("stop", "length")   # served (EOS may come first)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_the_trainers_on_the_same_tokens(vllm_engine, toy_model, temperature):
    model, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 5: what does the program print?")
    outs = _generate(vllm_engine, [prompt] * 4, [SamplingParams(max_new_tokens=40, temperature=temperature, seed=s)
                                                   for s in range(4)])
    mine = _trainer_logprobs(model, chat, prompt, outs, temperature)
    gaps = torch.cat([(torch.tensor(o.logprobs) - m).abs() for o, m in zip(outs, mine)])
    assert gaps.max().item() < 1e-3, f"engine vs trainer log-prob gap {gaps.max().item():.2e} (float32 both sides)"


def _perturbed(model, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """The model's weights, each tensor moved by noise of `scale` x its own std (the stale-weights fault's)."""
    from rstar2_core.faults import stale_weights

    return stale_weights(model.state_dict(), noise=scale, seed=7)


def test_a_weight_update_changes_what_the_engine_serves(vllm_engine, toy_model, tmp_path):
    """After `update_weights` (state dict, then a checkpoint URI) the engine's log-probs on fixed tokens
    equal the new weights' under the trainer (the weights really moved: the old ones are far off)."""
    from rstar2_core.models.io import save_checkpoint

    model, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 6: what does the program print?")
    greedy = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
    new_sd = _perturbed(model)
    new = _model_with(model, new_sd)
    try:
        vllm_engine.update_weights(new_sd)
        out = _generate(vllm_engine, [prompt], [greedy])[0]
        lp_new = _trainer_logprobs(new, chat, prompt, [out], 1.0)[0]
        lp_old = _trainer_logprobs(model, chat, prompt, [out], 1.0)[0]
        served = torch.tensor(out.logprobs)
        assert (served - lp_new).abs().max().item() < 1e-3
        assert (served - lp_old).abs().max().item() > 0.05
        # the same through a checkpoint URI, each worker reading it itself
        url = save_checkpoint(model, chat.tokenizer, (tmp_path / "orig").as_uri())
        vllm_engine.update_weights(url)
        back = _generate(vllm_engine, [prompt], [greedy])[0]
        lp_back = _trainer_logprobs(model, chat, prompt, [back], 1.0)[0]
        assert (torch.tensor(back.logprobs) - lp_back).abs().max().item() < 1e-3
    finally:
        vllm_engine.update_weights(model.state_dict())


def test_a_state_dict_goes_to_the_workers_in_chunks_below_the_rpc_limit(vllm_engine, toy_model, monkeypatch):
    """`update_weights(state_dict)` sends safetensors chunks of at most `weight_chunk_bytes` (vLLM's msgpack
    RPC takes no bytes object of 4 GiB or more: a whole 14B state dict is ~29.5 GB) and loads them once all
    arrived: the engine then serves the new weights exactly as a single message did."""
    from rstar2_core.rollout import vllm_engine as ve

    model, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 8: what does the program print?")
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    new_sd = _perturbed(model)
    sizes: list[int] = []
    real = ve.safetensors_chunks

    def counted(sd, max_bytes):
        for blob in real(sd, max_bytes):
            sizes.append(len(blob))
            yield blob

    monkeypatch.setattr(ve, "safetensors_chunks", counted)
    monkeypatch.setattr(vllm_engine, "weight_chunk_bytes", 64 * 1024)
    try:
        vllm_engine.update_weights(new_sd)
        out = _generate(vllm_engine, [prompt], [params])[0]
        lp_new = _trainer_logprobs(_model_with(model, new_sd), chat, prompt, [out], 1.0)[0]
        assert (torch.tensor(out.logprobs) - lp_new).abs().max().item() < 1e-3
        assert len(sizes) > 3, sizes                  # several messages (tests/unit/rollout: how they are cut)
    finally:
        vllm_engine.update_weights(model.state_dict())


def _model_with(model, state_dict):
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(state_dict)
    return other.eval()
