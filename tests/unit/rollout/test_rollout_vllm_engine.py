"""VLLMEngine's adapter logic, tested around a fake `vllm` module injected into sys.modules (vLLM does
not install here). What is checked: the request vLLM receives, output conversion, abort on cancel,
the weight-sync RPCs, KV capacity, and the error when vLLM is missing. Not checked: real vLLM."""

from __future__ import annotations

import asyncio
import importlib
import sys
from types import SimpleNamespace

import pytest
from vllm_fake import FakeAsyncLLM, RequestOutputKind, install_fake_vllm

from rstar2_core.rollout.types import SamplingParams


@pytest.fixture
def fake_vllm(monkeypatch):
    install_fake_vllm(monkeypatch)
    from rstar2_core.rollout import vllm_engine
    return vllm_engine


def test_requests_are_token_in_token_out_and_outputs_convert(fake_vllm):
    eng = fake_vllm.VLLMEngine("/ckpt", max_model_len=4096, tensor_parallel_size=2, seed=3)
    fake = FakeAsyncLLM.instances[0]
    assert fake.args.logprobs_mode == "processed_logprobs" and fake.args.enable_prefix_caching
    assert fake.args.tensor_parallel_size == 2 and fake.args.max_model_len == 4096
    mod, cls = fake.args.worker_extension_cls.rsplit(".", 1)
    assert getattr(importlib.import_module(mod), cls) is fake_vllm.WeightSyncExtension

    async def go():
        a = await eng.generate([7, 40], SamplingParams(max_new_tokens=5, temperature=0.6, top_p=0.9, seed=4,
                                                       stop_token_ids=(43,), stop_strings=("x",)))
        b = await eng.generate([45], SamplingParams(max_new_tokens=3))
        c = await eng.generate([47], SamplingParams(max_new_tokens=8, stop_strings=("x",)))
        return a, b, c
    a, b, c = asyncio.run(go())
    assert a.token_ids == (41, 42, 43) and a.finish_reason == "stop" and a.stop_string is None
    assert a.logprobs == pytest.approx((-0.1, -0.2, -0.3))         # the sampled token's entry, not the others
    assert b.token_ids == (46, 47, 48) and b.finish_reason == "length"
    assert c.token_ids == (48, 49, 50) and c.stop_string == "x"
    prompt, sp, _ = fake.calls[0]
    assert prompt == {"prompt_token_ids": [7, 40]}
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.n) == (5, 0.6, 0.9, 4, 1)
    assert sp.stop == ["x"] and sp.stop_token_ids == [43] and sp.include_stop_str_in_output
    assert sp.logprobs == 0 and sp.output_kind is RequestOutputKind.FINAL_ONLY and not sp.skip_special_tokens
    assert sp.detokenize and not fake.calls[1][1].detokenize      # detokenize only when stop strings need it
    assert len({c[2] for c in fake.calls}) == 3
    assert len(fake.loops) == 1 and fake.loops.pop() is eng._loop   # vLLM runs on the engine's own loop
    asyncio.run(eng.close())
    assert fake.shut


def test_cancel_aborts_and_weights_sync_through_rpc(fake_vllm):
    eng = fake_vllm.VLLMEngine("/ckpt", max_model_len=1024)
    fake = FakeAsyncLLM.instances[0]

    async def cancel_one():
        task = asyncio.ensure_future(eng.generate([1], SamplingParams(max_new_tokens=999)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if fake.aborted:
                break
            await asyncio.sleep(0.02)
    asyncio.run(cancel_one())
    assert fake.aborted == [fake.calls[0][2]]

    sd = {"w": 1}
    eng.update_weights(sd)
    eng.update_weights("s3://bucket/ckpt/step-3")
    assert fake.rpcs == [("rstar2_load_state_dict", (sd,)), ("rstar2_load_checkpoint", ("s3://bucket/ckpt/step-3",))]
    assert fake.resets == 2
    assert eng.kv_capacity_tokens() == 1600
    fixed = fake_vllm.VLLMEngine("/ckpt", max_model_len=1024, kv_capacity_tokens=777)
    assert fixed.kv_capacity_tokens() == 777
    asyncio.run(fixed.close())
    fake.vllm_config.cache_config.num_gpu_blocks = None
    with pytest.raises(RuntimeError, match="rollout.kv_capacity_tokens"):
        eng.kv_capacity_tokens()
    asyncio.run(eng.close())


def test_worker_extension_loads_into_the_model_runner(fake_vllm):
    loaded = []
    worker = type("W", (fake_vllm.WeightSyncExtension,), {})()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: loaded.extend(weights)))
    assert worker.rstar2_load_state_dict({"a": 1, "b": 2}) == 2
    assert loaded == [("a", 1), ("b", 2)]


def test_missing_logprobs_and_missing_vllm_are_clear_errors(fake_vllm, monkeypatch):
    bad = SimpleNamespace(token_ids=[1, 2], logprobs=None, finish_reason="stop", stop_reason=None)
    with pytest.raises(ValueError, match="logprobs=0"):
        fake_vllm.convert_output(bad)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="gpu extra"):
        fake_vllm.VLLMEngine("/ckpt", max_model_len=1024)


def test_weight_transfer_pauses_generation_and_sleep_mode_is_forwarded(fake_vllm):
    """rollout.weight_sync = nccl/ipc: the engine is built with vLLM's weight-transfer backend, joins the
    trainer's group with its rank offset, and loads each update with generation paused around it and the
    prefix cache reset before generation resumes; sleep/wake_up reach vLLM's sleep mode."""
    eng = fake_vllm.VLLMEngine("/ckpt", max_model_len=1024, weight_transfer="nccl", max_num_seqs=32)
    fake = FakeAsyncLLM.instances[0]
    assert fake.args.weight_transfer_config.backend == "nccl" and fake.args.enable_sleep_mode
    assert fake.args.max_num_seqs == 32
    eng.init_weight_transfer("10.0.0.1", 29600, 3, 65)
    eng.receive_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]], "packed": True})
    eng.sleep(1)
    eng.wake_up(["weights"])
    assert fake.events == [
        ("init", {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 3, "world_size": 65}),
        ("pause", "keep"), ("update", {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]],
                                       "packed": True}),
        "reset", "resume", ("sleep", 1), ("wake_up", ["weights"])]
    plain = fake_vllm.VLLMEngine("/ckpt")
    assert "max_model_len" not in vars(FakeAsyncLLM.instances[1].args)   # vLLM takes it from the model config
    with pytest.raises(ValueError, match="weight-transfer backend"):
        plain.receive_weights({})
    assert eng.busy_seconds() == 0.0
    asyncio.run(eng.generate([1], SamplingParams(max_new_tokens=2)))
    assert eng.busy_seconds() > 0.0
    asyncio.run(eng.close())
    asyncio.run(plain.close())


def test_weight_transfer_groups_and_buckets_of_the_production_layout():
    from rstar2_core.cluster.layout import compute_layout
    from rstar2_core.cluster.weight_sync import IPCSync, buckets, nccl_group
    from rstar2_core.config import load_config

    assert nccl_group([2, 2, 2]) == (7, [1, 3, 5])
    assert buckets([4, 4, 9, 1, 1], 8) == [[0, 1], [2], [3, 4]]
    cfg = load_config("qwen3-14b-mi300x")
    rt = SimpleNamespace(layout=compute_layout(cfg))
    ranks = IPCSync.colocated_ranks(SimpleNamespace(rt=rt))
    assert len(ranks) == 32 and ranks[0] == [0, 1] and ranks[5] == [10, 11] and ranks[31] == [62, 63]
    sep = load_config("qwen3-14b-mi300x", ['cluster.layout="separate"', "cluster.trainer_gpus=32",
                                           "rollout.num_engines=16", 'rollout.weight_sync="nccl"'])
    with pytest.raises(ValueError, match="colocated"):
        IPCSync.colocated_ranks(SimpleNamespace(rt=SimpleNamespace(layout=compute_layout(sep))))
