"""TorchBackend: schedule, clipping, exact resume from state_dict, optimizer reset."""

import itertools
import math

import pytest
import torch
from torch import nn

from rstar2_core.config import SFTConfig
from rstar2_core.models.backend import TorchBackend, TrainBackend, lr_factor, make_backend


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _train(backend, steps, start=0):
    for i in range(start, start + steps):
        x, y = _batch(i)
        backend.backward(((backend.model(x) - y) ** 2).mean())
        backend.step()


def test_lr_factor_warmup_then_cosine_to_floor():
    f = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(12)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(f[2:]))
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)
    assert lr_factor(7, 10, 2, "constant") == 1.0
    with pytest.raises(ValueError, match="valid"):
        lr_factor(0, 10, 2, "linear")


def test_scheduler_drives_optimizer_lr():
    b = TorchBackend(_model(), lr=1e-2, total_steps=6, warmup_steps=2, schedule="cosine")
    seen = []
    for i in range(6):
        seen.append(b.current_lr)
        _train(b, 1, start=i)
    assert seen[0] == pytest.approx(5e-3) and seen[1] == pytest.approx(1e-2)
    assert seen[5] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


def test_step_clips_and_returns_preclip_norm():
    m = _model()
    b = TorchBackend(m, lr=0.0 + 1e-9, total_steps=1, grad_clip=0.01)
    x, y = _batch(0)
    b.backward(((m(x) - y) ** 2).mean() * 1000)
    grads_before = torch.sqrt(sum((p.grad ** 2).sum() for p in m.parameters()))
    norm = b.step()
    assert norm == pytest.approx(float(grads_before), rel=1e-5) and norm > 0.01
    assert all(p.grad is None for p in m.parameters())


def test_resume_from_state_dict_is_exact():
    a = TorchBackend(_model(), lr=1e-2, total_steps=8, warmup_steps=2)
    _train(a, 8)
    b = TorchBackend(_model(), lr=1e-2, total_steps=8, warmup_steps=2)
    _train(b, 4)
    state = {k: v for k, v in b.state_dict().items()}
    weights = {k: v.clone() for k, v in b.model.state_dict().items()}
    c_model = _model(seed=5)
    c_model.load_state_dict(weights)
    c = TorchBackend(c_model, lr=1e-2, total_steps=8, warmup_steps=2)
    c.load_state_dict(state)
    _train(c, 4, start=4)
    for (k, va), vc in zip(a.model.state_dict().items(), c.model.state_dict().values()):
        assert torch.equal(va, vc), k
    assert c.global_step == 8


def test_reset_optimizer_clears_moments_keeps_schedule():
    b = TorchBackend(_model(), lr=1e-2, total_steps=10, warmup_steps=4)
    _train(b, 3)
    lr_before = b.current_lr
    assert b.optimizer.state
    b.reset_optimizer()
    assert not b.optimizer.state
    assert b.current_lr == pytest.approx(lr_before)
    _train(b, 1, start=3)
    assert b.current_lr == pytest.approx(1e-2 * lr_factor(4, 10, 4, "cosine"))


def test_make_backend_from_config_and_errors():
    b = make_backend(_model(), SFTConfig(lr=3e-3, grad_clip=0.5), total_steps=5, warmup_steps=0,
                     schedule="constant")
    assert isinstance(b, TrainBackend) and b.grad_clip == 0.5 and b.current_lr == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="valid"):
        TorchBackend(_model(), lr=1e-3, total_steps=5, schedule="poly")
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"step": 1})


def test_sft_betas_reach_the_optimizer_and_bad_ones_are_refused():
    b = make_backend(_model(), SFTConfig(lr=3e-3, betas=(0.9, 0.95)), total_steps=5, warmup_steps=0,
                     schedule="constant")
    assert b.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert make_backend(_model(), SFTConfig(lr=3e-3), total_steps=5, warmup_steps=0,
                        schedule="constant").optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="less than 1"):
        SFTConfig(betas=(0.9, 1.0))


def test_gradient_checkpointing_on_a_model_without_it_is_refused():
    with pytest.raises(ValueError, match="model.gradient_checkpointing = false"):
        TorchBackend(_model(), lr=1e-3, total_steps=2, gradient_checkpointing=True)
