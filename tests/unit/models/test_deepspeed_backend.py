"""DeepSpeedBackend on CPU (gloo, one process): ZeRO 0, 2 and 3 steps match TorchBackend's on the same tiny
model (ZeRO-3 compared through its gathered HF export); optimizer reset, state round trip and HF export
behave like the torch backend's."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys

import deepspeed  # noqa: F401  (the backend under test imports it: a missing install fails, never skips)
import pytest
import torch
from numerics import same_adam_update

from rstar2_core.models.backend import TorchBackend
from rstar2_core.models.deepspeed_backend import DeepSpeedBackend, deepspeed_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).float()


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 12), generator=g) for _ in range(n)]


def _train(backend, batches_per_step, scale=1.0):
    norms = []
    for batches in batches_per_step:
        for ids in batches:
            loss = backend.model(input_ids=ids, labels=ids).loss / len(batches) * scale
            backend.backward(loss)
        norms.append(backend.step())
    return norms


def _params(model) -> dict[str, torch.Tensor]:
    m = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in m.named_parameters()}


KW = {"lr": 1e-2, "total_steps": 10, "warmup_steps": 2, "schedule": "cosine", "weight_decay": 0.01, "grad_clip": 0.5}


_NO_DIST_ENV = f"""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from rstar2_core.models.deepspeed_backend import DeepSpeedBackend
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
assert not torch.distributed.is_initialized()
try:
    DeepSpeedBackend(model, zero_stage=0, **{KW!r})
except RuntimeError as e:
    print("RuntimeError:", e)
else:
    print("no error")
"""


def test_missing_dist_env_names_the_variables():
    """In a fresh interpreter: this session's process group (the `dist_env` fixture) would otherwise decide,
    by test order, whether there is anything to check."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", _NO_DIST_ENV], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RuntimeError:") and "MASTER_ADDR" in proc.stdout, \
        proc.stdout[-2000:]


def _trained_weights(ds, stage: int, tmp_path) -> dict[str, torch.Tensor]:
    """The backend's full weights: ZeRO-3 partitions them, so go through the HF export (the gather)."""
    if stage < 3:
        return _params(ds.model)
    from transformers import Qwen2ForCausalLM

    ds.save_hf(tmp_path / "z3")
    return _params(Qwen2ForCausalLM.from_pretrained(tmp_path / "z3"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_step_matches_torch_backend(dist_env, stage, tmp_path):
    base = _tiny_model()
    steps = [_batches(2, seed=s) for s in range(3)]  # 3 optimizer steps x 2 micro-batches
    ref = TorchBackend(copy.deepcopy(base), **KW)
    ref_norms = _train(ref, steps)
    ds = DeepSpeedBackend(copy.deepcopy(base), zero_stage=stage, **KW)
    try:
        assert not ds.bf16
        ds_norms = _train(ds, steps)
        assert ds_norms == pytest.approx(ref_norms, rel=1e-4)
        assert ds.current_lr == pytest.approx(ref.current_lr)
        a, b = _params(ref.model), _trained_weights(ds, stage, tmp_path)
        assert a.keys() == b.keys()
        w0 = base.state_dict()
        moved = max(float((a[k] - w0[k]).abs().max()) for k in a)
        assert moved > 1e-3  # the weights did change, so the comparison below means something
        for k in a:
            assert same_adam_update(b[k] - w0[k], a[k] - w0[k], KW["lr"]), k
    finally:
        ds.close()


@pytest.mark.slow
def test_reset_optimizer_state_roundtrip_and_hf_export(dist_env, tmp_path):
    from transformers import Qwen2ForCausalLM

    from rstar2_core.config import SFTConfig
    from rstar2_core.models.backend import make_backend

    base = _tiny_model(seed=3)
    sft = SFTConfig(lr=KW["lr"], weight_decay=KW["weight_decay"], grad_clip=KW["grad_clip"], backend="deepspeed",
                    zero_stage=2)
    ds = make_backend(copy.deepcopy(base), sft, total_steps=10, warmup_steps=2, schedule="cosine")  # the factory
    try:
        assert isinstance(ds, DeepSpeedBackend) and ds.config["gradient_clipping"] == KW["grad_clip"]
        _train(ds, [_batches(1, seed=7)])
        saved = ds.state_dict()
        assert saved["step"] == 1 and saved["zero_stage"] == 2
        ds.load_state_dict(saved)
        with pytest.raises(ValueError, match="zero_stage"):
            ds.load_state_dict({**saved, "zero_stage": 3})
        # after reset, a step equals a fresh AdamW step from the same weights at the same lr position
        ds.reset_optimizer()
        ref_model = copy.deepcopy(ds.model.module)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=KW["lr"] * ds._factor(1),
                                    weight_decay=KW["weight_decay"])
        batch = [_batches(1, seed=9)]
        _train(ds, batch)
        for ids in batch[0]:
            ref_model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), KW["grad_clip"])
        ref_opt.step()  # fresh moments: a step with kept moments would differ
        a, b = _params(ref_model), _params(ds.model)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
        ds.save_hf(tmp_path / "hf")
        back = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf")
        for k, v in _params(back).items():
            torch.testing.assert_close(v, b[k])
    finally:
        ds.close()


def test_config_shape_and_bad_stage():
    c = deepspeed_config(zero_stage=3, grad_clip=1.0, bf16=True, micro_batch_size=2, world_size=64)
    assert c["zero_optimization"]["stage"] == 3
    assert c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert c["bf16"]["enabled"] and c["train_batch_size"] == 128
    assert c["managed_gradient_accumulation"] is False
    with pytest.raises(ValueError, match="ZeRO stages"):
        deepspeed_config(zero_stage=4, grad_clip=1.0, bf16=False)


def test_bf16_on_cpu_is_refused_with_a_fix(dist_env):
    with pytest.raises(ValueError, match="float32"):
        DeepSpeedBackend(_tiny_model().to(torch.bfloat16), zero_stage=2, **KW)
