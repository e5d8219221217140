"""VLLMEngine on a GPU, where this machine cannot run it: what the adapter asks of vLLM's engine there
(tensor parallelism, the GPU memory share, sleep mode, the weight-transfer backend and protocol), with
vLLM's own argument, sampling and request classes and the stand-in engine of tests/vllm_fake.py (it refuses
what vLLM 0.32 refuses; tests/vllm/test_vllm_protocol.py holds it to the real engine). Generation, logprobs, abort and weight updates run against the real CPU
build in tests/vllm/."""

from __future__ import annotations

import asyncio
import importlib
import sys

import pytest
from vllm.sampling_params import RequestOutputKind
from vllm_fake import FakeAsyncLLM, fake_checkpoint, install_fake_vllm

from rstar2_core.rollout.types import SamplingParams


@pytest.fixture
def fake_vllm(monkeypatch):
    install_fake_vllm(monkeypatch)
    from rstar2_core.rollout import vllm_engine
    return vllm_engine


def test_engine_arguments_on_a_gpu(fake_vllm, tmp_path):
    ckpt = fake_checkpoint(tmp_path)
    eng = fake_vllm.VLLMEngine(ckpt, max_model_len=4096, tensor_parallel_size=2, seed=3, max_num_seqs=32)
    args = FakeAsyncLLM.instances[0].args
    assert args.model == ckpt and args.logprobs_mode == "processed_logprobs" and args.enable_prefix_caching
    assert args.tensor_parallel_size == 2 and args.max_model_len == 4096 and args.max_num_seqs == 32
    assert args.gpu_memory_utilization == 0.85 and args.kv_cache_memory_bytes is None     # vLLM's defaults
    assert not args.enable_sleep_mode and not args.enforce_eager and args.weight_transfer_config is None
    mod, cls = args.worker_extension_cls.rsplit(".", 1)
    assert getattr(importlib.import_module(mod), cls) is fake_vllm.WeightSyncExtension
    out = asyncio.run(eng.generate([7, 40], SamplingParams(max_new_tokens=3, stop_strings=("x",))))
    sp = FakeAsyncLLM.instances[0].calls[0][1]
    assert sp.logprobs == 0 and sp.output_kind is RequestOutputKind.FINAL_ONLY and sp.include_stop_str_in_output
    assert out.token_ids == (41, 42, 43) and out.logprobs == pytest.approx((-0.1, -0.2, -0.3))
    # a KV budget in tokens becomes vLLM's byte budget from the model's shape (2 x layers x kv heads x head dim)
    sized = fake_vllm.VLLMEngine(ckpt, kv_capacity_tokens=1000, dtype="bfloat16", gpu_memory_utilization=0.6)
    a = FakeAsyncLLM.instances[1].args
    assert a.kv_cache_memory_bytes == 1000 * 2 * 1 * 2 * 32 * 2 and a.gpu_memory_utilization == 0.6
    assert sized.kv_capacity_tokens() == 1600               # what vLLM allocated, not what was asked
    for e in (eng, sized):
        asyncio.run(e.close())


def test_weight_transfer_protocol_and_sleep_mode_on_a_gpu(fake_vllm, tmp_path):
    """rollout.weight_sync = nccl: the engine joins the trainer's group with its init info, and each push
    is one update (generation paused, start, the chunk, finish, prefix cache reset, resumed); sleep mode
    reaches vLLM when asked for, and only then."""
    ckpt = fake_checkpoint(tmp_path)
    eng = fake_vllm.VLLMEngine(ckpt, weight_transfer="nccl", sleep_mode=True)
    fake = FakeAsyncLLM.instances[0]
    assert fake.args.weight_transfer_config.backend == "nccl" and fake.args.enable_sleep_mode
    init = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 3, "world_size": 65, "packed": True}
    eng.init_weight_transfer(init)
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}
    eng.receive_weights(update)
    eng.sleep(1)
    eng.wake_up(["weights"])
    assert fake.events == [("init", init), ("pause", "keep"), "start", ("update", update), "finish", "reset", "resume",
                           ("sleep", 1), ("wake_up", ["weights"])]
    # an update the pinned vLLM refuses fails the push, and the half-loaded engine refuses to serve
    with pytest.raises(Exception, match="unexpected keyword argument 'packed'"):
        eng.receive_weights({**update, "packed": True})
    with pytest.raises(RuntimeError, match="half-loaded"):
        asyncio.run(eng.generate([1], SamplingParams(max_new_tokens=2)))
    # the infos are parsed by vLLM's own classes: an IPC chunk without its handles is refused as vLLM refuses it
    ipc = fake_vllm.VLLMEngine(ckpt, weight_transfer="ipc")
    ipc.init_weight_transfer({"packed": True})
    with pytest.raises(Exception, match="Either `ipc_handles` or `ipc_handles_pickled` must be provided"):
        ipc.receive_weights({**update, "tensor_sizes": [8]})
    plain = fake_vllm.VLLMEngine(ckpt)
    with pytest.raises(Exception, match="Weight transfer not configured"):
        plain.receive_weights(update)
    with pytest.raises(Exception, match="Sleep mode is not enabled"):
        plain.sleep(1)
    for e in (eng, ipc, plain):
        asyncio.run(e.close())


def test_missing_logprobs_and_missing_vllm_are_clear_errors(fake_vllm, monkeypatch, tmp_path):
    from types import SimpleNamespace

    bad = SimpleNamespace(token_ids=[1, 2], logprobs=None, finish_reason="stop", stop_reason=None)
    with pytest.raises(ValueError, match="logprobs=0"):
        fake_vllm.convert_output(bad)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="make setup"):
        fake_vllm.VLLMEngine(fake_checkpoint(tmp_path), max_model_len=1024)


def test_weight_transfer_groups_and_buckets_of_the_production_layout():
    from types import SimpleNamespace

    from rstar2_core.config import load_config
    from rstar2_core.runtime.ray.weight_sync import IPCSync, buckets, nccl_group
    from rstar2_core.runtime.specs import layout_for

    assert nccl_group([2, 2, 2]) == (7, [1, 3, 5])
    assert buckets([4, 4, 9, 1, 1], 8) == [[0, 1], [2], [3, 4]]
    cfg = load_config("qwen3-14b-mi300x")
    rt = SimpleNamespace(layout=layout_for(cfg))
    ranks = IPCSync.colocated_ranks(SimpleNamespace(rt=rt))
    assert len(ranks) == 32 and ranks[0] == [0, 1] and ranks[5] == [10, 11] and ranks[31] == [62, 63]
    sep = load_config("qwen3-14b-mi300x", ['cluster.layout="separate"', "cluster.trainer_gpus=32",
                                           "rollout.num_engines=16", 'rollout.weight_sync="nccl"'])
    with pytest.raises(ValueError, match="colocated"):
        IPCSync.colocated_ranks(SimpleNamespace(rt=SimpleNamespace(layout=layout_for(sep))))


def test_an_engine_actor_with_tp_over_ray_drops_the_visible_devices_ray_set():
    """TP > 1: the actor holds no GPU (its workers do, through vLLM's Ray executor); Ray gave it empty
    CUDA/HIP/ROCR_VISIBLE_DEVICES, which would hide every GPU from vLLM's planning there."""
    from rstar2_core.runtime.engine_builder import EngineSpec
    from rstar2_core.runtime.ray.engine_actors import clear_visible_devices

    spec = EngineSpec("vllm", "file:///ckpt", 1024, tensor_parallel_size=2)
    env = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "", "PATH": "/bin"}
    assert clear_visible_devices(spec.for_actor("cuda", tp_over_ray=False), env) == []
    assert "CUDA_VISIBLE_DEVICES" in env
    removed = clear_visible_devices(spec.for_actor("cuda", tp_over_ray=True), env)
    assert sorted(removed) == ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"]
    assert env == {"PATH": "/bin"}
