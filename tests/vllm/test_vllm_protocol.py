"""vLLM's weight-transfer protocol on the real engine (CPU build, NCCL backend configured, no group joined)
and on the stand-in engine used where the transfer needs GPUs (tests/vllm_fake.py, which parses the infos
with vLLM's own classes): the same calls get the same answers. Plus the adapter's own refusals on CPU and
its guard after a failed update."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest
import torch
from vllm_fake import fake_checkpoint, install_fake_vllm

from rstar2_core.rl.logprobs import sequence_logprobs
from rstar2_core.rollout.types import SamplingParams, Trajectory

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VALID = {"names": [], "dtype_names": [], "shapes": []}
PROTOCOL = [
    ("update without a start", "update", VALID),
    ("finish without a start", "finish", None),
    ("start", "start", None),
    ("a second start", "start", None),
    ("an unknown update key", "update", {**VALID, "packed": True}),
    ("an update after a failed one", "update", VALID),
    ("start again", "start", None),
    ("a missing update key", "update", {"names": [], "dtype_names": []}),
    ("an unknown init key", "init", {"rank_offset": 1, "world_size": 2, "bogus": 1}),
    ("a missing init key", "init", {"world_size": 2, "master_address": "127.0.0.1", "master_port": 1}),
]


def _run_protocol(engine) -> list[str]:
    """Each step's outcome on vLLM's AsyncLLM: "ok", or the worker's error text."""
    base = sys.modules["vllm.distributed.weight_transfer.base"]
    llm = engine._engine
    calls = {"start": lambda _: llm.start_weight_update(), "finish": lambda _: llm.finish_weight_update(),
             "update": lambda i: llm.update_weights(base.WeightTransferUpdateRequest(update_info=i)),
             "init": lambda i: llm.init_weight_transfer_engine(base.WeightTransferInitRequest(init_info=i))}
    out = []
    for _, call, info in PROTOCOL:
        try:
            engine._call(calls[call](info))
            out.append("ok")
        except Exception as e:  # noqa: BLE001 - the outcome is what is compared
            m = re.search(r"Worker failed with error '(.*)', please check", str(e), re.DOTALL)
            out.append(m.group(1) if m else f"{type(e).__name__}: {e}")
    return out


def _serves_the_toy_policy(engine, toy_model) -> float:
    model, chat = toy_model
    prompt = chat.prompt_ids("Toy problem 8: what does the program print?")
    out = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=16, seed=5)))
    t = Trajectory(tuple(prompt), out.token_ids, (1,) * len(out.token_ids), out.logprobs, "", (), 1, 0, "eos", False)
    mine = sequence_logprobs(model, [t], chat.tokenizer.pad_token_id, 1.0)[0]
    return (torch.tensor(out.logprobs) - mine).abs().max().item()


@pytest.fixture(scope="module")
def real_outcomes(vllm_engine, toy_model):
    outcomes = _run_protocol(vllm_engine)
    # a failed update leaves the layers unloaded; whole weights through the worker extension restore them
    vllm_engine.update_weights(toy_model[0].state_dict())
    assert _serves_the_toy_policy(vllm_engine, toy_model) < 1e-3
    return outcomes


def test_the_real_engine_refuses_what_the_protocol_forbids(real_outcomes):
    got = dict(zip([p[0] for p in PROTOCOL], real_outcomes))
    assert got["update without a start"] == "start_weight_update must be called before update_weights."
    assert got["finish without a start"] == "finish_weight_update called without a matching start_weight_update."
    assert got["start"] == "ok" and got["start again"] == "ok"
    assert got["a second start"].startswith("start_weight_update called while a weight update is already active")
    assert "unexpected keyword argument 'packed'" in got["an unknown update key"]
    assert got["an update after a failed one"] == got["update without a start"]     # the failure closed it
    assert "missing 1 required positional argument: 'shapes'" in got["a missing update key"]
    assert "unexpected keyword argument 'bogus'" in got["an unknown init key"]
    assert "missing 1 required keyword-only argument: 'rank_offset'" in got["a missing init key"]


def test_the_fake_answers_the_protocol_as_the_real_engine_does(real_outcomes, monkeypatch, tmp_path):
    install_fake_vllm(monkeypatch)
    from rstar2_core.rollout.vllm_engine import VLLMEngine

    fake = VLLMEngine(fake_checkpoint(tmp_path), weight_transfer="nccl")
    try:
        assert _run_protocol(fake) == real_outcomes
    finally:
        asyncio.run(fake.close())


def test_after_a_failed_update_the_adapter_refuses_to_serve_until_whole_weights_load(vllm_engine, toy_model):
    """The adapter's guard: generating on half-loaded layers would kill vLLM's engine core."""
    vllm_engine.start_weight_update()
    with pytest.raises(Exception, match="unexpected keyword argument"):
        vllm_engine.receive_weight_chunk({**VALID, "packed": True})
    vllm_engine.abort_weight_update()
    with pytest.raises(RuntimeError, match="half-loaded .*a weight update failed"):
        asyncio.run(vllm_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
    vllm_engine.update_weights(toy_model[0].state_dict())
    assert _serves_the_toy_policy(vllm_engine, toy_model) < 1e-3


def test_cpu_refuses_what_it_cannot_honour(toy_dir):
    """Checked before vLLM starts: sleep mode (CUDA/ROCm only), a GPU memory share, a non-folder model."""
    from rstar2_core.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="release_memory_during_training = false"):
        VLLMEngine(toy_dir, max_model_len=256, sleep_mode=True)
    with pytest.raises(ValueError, match="remove rollout.gpu_memory_utilization"):
        VLLMEngine(toy_dir, max_model_len=256, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="local checkpoint folder"):
        VLLMEngine("file://" + toy_dir, max_model_len=256)
