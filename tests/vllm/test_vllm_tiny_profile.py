"""The tiny profile's architecture in the real vLLM (CPU build): the model `make demo` trains (Qwen3: four heads
of 32 over a 64-wide stream, two key/value heads, RMS-normed queries and keys, tied embeddings) loads, serves
the trainer's log-probs, and takes a weight push, its q_norm / k_norm weights included. The toy policy the other
vLLM tests serve is a Qwen2 model (tests/toy_policy.py), so without this test `rollout.engine = "vllm"` on the
tiny profile would be untested."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_vllm_engine import _generate, _model_with, _perturbed, _trainer_logprobs

from rstar2_core.rollout.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def profile_model(toy_model, tmp_path_factory):
    """A freshly initialised model of the tiny profile's shape (the toy policy's tokenizer), saved to a folder."""
    from rstar2_core.config import load_config
    from rstar2_core.models.io import local_checkpoint_dir, save_checkpoint
    from rstar2_core.models.tiny import build_tiny_model

    _, chat = toy_model
    shape = load_config("tiny").model.tiny
    model = build_tiny_model(shape, chat.tokenizer, seed=3).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 32
    url = save_checkpoint(model, chat.tokenizer, tmp_path_factory.mktemp("tiny-profile").as_uri() + "/ckpt")
    return model, chat, str(local_checkpoint_dir(url))


def test_the_profiles_architecture_serves_the_trainers_logprobs_and_takes_a_weight_push(profile_model):
    from rstar2_core.rollout.vllm_engine import VLLMEngine

    model, chat, folder = profile_model
    engine = VLLMEngine(folder, max_model_len=1024, max_num_seqs=4, dtype="float32", seed=0)
    try:
        prompt = chat.prompt_ids("Toy problem 9: what does the program print?")
        params = [SamplingParams(max_new_tokens=32, temperature=1.0, seed=s) for s in range(2)]
        outs = _generate(engine, [prompt] * 2, params)
        mine = _trainer_logprobs(model, chat, prompt, outs, 1.0)
        gap = torch.cat([(torch.tensor(o.logprobs) - m).abs() for o, m in zip(outs, mine)]).max().item()
        assert gap < 1e-3, f"engine vs trainer log-prob gap {gap:.2e} (float32 both sides)"
        new_sd = _perturbed(model)
        assert any(k.endswith("self_attn.q_norm.weight") for k in new_sd)     # pushed like every other weight
        new = _model_with(model, new_sd)
        engine.update_weights(new_sd)
        out = _generate(engine, [prompt], [params[0]])[0]
        served = torch.tensor(out.logprobs)
        assert (served - _trainer_logprobs(new, chat, prompt, [out], 1.0)[0]).abs().max().item() < 1e-3
        assert (served - _trainer_logprobs(model, chat, prompt, [out], 1.0)[0]).abs().max().item() > 0.05
    finally:
        asyncio.run(engine.close())
