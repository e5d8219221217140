"""ZeRO++ hpZ (`rl.zero_hpz_partition_size`, `sft.zero_hpz_partition_size`) reaches DeepSpeed: the config key is
written and refused where DeepSpeed cannot honour it, and 4 gloo ranks with a secondary partition of 2 take the
same steps (losses, gradient norms) as without it, with DeepSpeed reporting the partition it runs."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from rstar2_core.config import load_config
from rstar2_core.models.backend import backend_options
from rstar2_core.models.deepspeed_backend import deepspeed_config


def test_the_setting_reaches_deepspeeds_config_and_is_refused_where_it_cannot_work():
    z = deepspeed_config(zero_stage=3, grad_clip=1.0, bf16=False, world_size=16, hpz_partition_size=8)
    assert z["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert "zero_hpz_partition_size" not in deepspeed_config(zero_stage=3, grad_clip=1.0, bf16=False,
                                                             world_size=16)["zero_optimization"]
    for stage, world in ((2, 16), (3, 6)):
        with pytest.raises(ValueError, match="needs ZeRO-3 and a world size it divides"):
            deepspeed_config(zero_stage=stage, grad_clip=1.0, bf16=False, world_size=world, hpz_partition_size=4)
    prod = load_config("qwen3-14b-mi300x")
    opts = backend_options(prod.rl, prod.model, total_steps=10, warmup_steps=1, schedule="constant")
    assert opts["hpz_partition_size"] == 8


def _steps(world: int, hpz: int, rank: int) -> tuple[int, list[float]]:
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

    ds = deepspeed_config(zero_stage=3, grad_clip=1.0, bf16=False, world_size=world, hpz_partition_size=hpz)
    keep = HfDeepSpeedConfig(ds)   # noqa: F841 - from_config builds under zero.Init while it lives
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).float()
    b = DeepSpeedBackend(model, zero_stage=3, lr=1e-2, total_steps=3, hpz_partition_size=hpz)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 12), generator=g)
        loss = b.model(input_ids=ids, labels=ids).loss
        b.backward(loss)
        steps += [float(loss), b.step()]
    size = b.engine.zero_hpz_partition_size()
    b.close()
    return size, steps


def _rank(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    from rstar2_core.models.deepspeed_backend import init_single_process_distributed

    init_single_process_distributed("gloo")
    out.put((rank, _steps(world, 1, rank), _steps(world, 2, rank)))


@pytest.mark.slow
def test_hpz_runs_on_gloo_and_takes_the_same_steps():
    world = 4
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(got) == world
    for rank, (flat_size, flat), (hpz_size, hpz) in got:
        assert (flat_size, hpz_size) == (1, 2)
        assert hpz == pytest.approx(flat, rel=1e-5) and len(flat) == 4, rank
