"""The trainers' start-up kernel comparison (rstar2_core/models/kernel_check.py), on the CPU.

torch's CPU FlexAttention has no backward, so the candidate kernels here are registered by the tests: a
dense-mask SDPA reference that is exact (the check passes, its figures are the real loss and gradient
norm, and the step after it is the step without it, under the torch backend and DeepSpeed ZeRO 0/2/3), and
deliberately wrong ones (a scaled output, a backward that halves dQ/dK/dV, NaN) that the SFT and RL steps
refuse before their optimizer step, naming `model.attention_kernel` and `segments`. A check that measured
nothing, or compared a kernel with itself, fails these tests.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

from rstar2_core.config import ConfigError, load_config
from rstar2_core.errors import AttentionKernelMismatch
from rstar2_core.models.backend import TorchBackend, backend_options, make_backend
from rstar2_core.models.kernel_check import compare_kernels
from rstar2_core.models.packed_attention import (
    KERNELS,
    Segments,
    segment_attention,
    segment_attention_forward,
)
from rstar2_core.rl.trainer import merge_rank_metrics as rl_merge
from rstar2_core.rl.trainer import rl_update
from rstar2_core.rollout.types import Trajectory
from rstar2_core.sft.packing import collate, pack
from rstar2_core.sft.step import masked_token_loss, sft_update


def _dense(module, query, key, value, attention_mask, scaling=None, dropout=0.0, segments=None, **kw):
    """Reference: one SDPA call with the dense (B, 1, T, T) mask the segments describe (pad rows zeroed)."""
    b, h, t, _ = query.shape
    doc = torch.full((b, t), -1)
    for i, seg in enumerate(segments):
        doc[i, :seg.prefix] = 0
        for j, (s, e) in enumerate(seg.spans):
            doc[i, s:e] = j + 1
    dq, dk = doc[:, :, None], doc[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = causal & (dq >= 0) & ((dq == dk) | (dk == 0)) | torch.eye(t, dtype=torch.bool)  # pad sees itself
    rep = h // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scaling)
    return (out * (doc >= 0)[:, None, :, None]).transpose(1, 2).contiguous(), None


def _scaled(*args, **kwargs):
    out, _ = segment_attention_forward(*args, **kwargs)
    return out * 1.5, None


class _HalfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


def _wrong_backward(module, query, key, value, *args, **kwargs):
    q, k, v = (_HalfGrad.apply(x) for x in (query, key, value))     # forward exact, dQ/dK/dV halved
    return segment_attention_forward(module, q, k, v, *args, **kwargs)


def _nan(*args, **kwargs):
    out, _ = segment_attention_forward(*args, **kwargs)
    return out * float("nan"), None


CANDIDATES = {"dense": _dense, "scaled": _scaled, "wrong_backward": _wrong_backward, "nan": _nan}


@pytest.fixture
def kernels(monkeypatch):
    """The test kernels, registered with transformers and named in KERNELS for this test."""
    for name, fn in CANDIDATES.items():
        AttentionInterface.register(f"rstar2_test_{name}", fn)
        monkeypatch.setitem(KERNELS, name, f"rstar2_test_{name}")


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).float()


def _rows():
    prefix = list(range(2, 8))
    docs = [(prefix + [20 + i] * (3 + 2 * i), [0] * 6 + [1] * (3 + 2 * i)) for i in range(6)]
    return pack(docs, 40, pad_id=0, prefix=prefix)


def _trajectories(n=6, seed=0):
    rng = random.Random(seed)
    prefix = [2, 3, 4, 5]
    out = []
    for _ in range(n):
        r = rng.randint(3, 12)
        out.append(Trajectory(tuple(prefix + [rng.randrange(6, 96) for _ in range(rng.randint(1, 5))]),
                              tuple(rng.randrange(6, 96) for _ in range(r)), (1,) * r, (-1.0,) * r, "", (), 1, 1,
                              "answer", False))
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    m = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def _mean_loss(model, kernel):
    loss, n = masked_token_loss(model, collate(_rows(), "cpu", torch.float32), kernel)
    return loss / n


def test_an_exact_kernel_passes_with_the_real_loss_and_gradient_norm(kernels):
    model = _model()
    check = compare_kernels(model, _mean_loss, reference="segments", candidate="dense", loss_tol=1e-4, grad_tol=1e-3)
    with segment_attention(model):
        loss = _mean_loss(model, "segments")
        loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert check.ok and check.loss[0] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert check.grad_norm[0] == pytest.approx(norm, rel=1e-5) and check.grad_norm[0] > 0.1
    assert check.group_norm["attention"][0] > 0 and check.group_norm["mlp"][0] > 0
    assert check.loss_rel_diff < 1e-5 and check.grad_norm_rel_diff < 1e-5
    m = check.metrics("sft/")
    assert m["sft/kernel_check_passed"] == 1.0 and m["sft/kernel_check_seconds_dense"] > 0


def test_the_check_runs_once_and_leaves_the_steps_unchanged(kernels):
    """Two steps with a check before the first equal two steps without (gradient checkpointing on: the
    backward re-runs the layers under the kernel being checked); the figures come with the first step only."""
    runs = {}
    for due in (False, True):
        model = _model()
        backend = TorchBackend(model, lr=1e-2, total_steps=2, schedule="constant", attention_kernel="dense",
                               kernel_check=due, gradient_checkpointing=True)
        steps = [sft_update(backend, _rows(), micro_batch_size=2, pad_id=0) for _ in range(2)]
        runs[due] = (steps, _weights(model))
        assert not backend.kernel_check_due
    (plain, w_plain), (checked, w_checked) = runs[False], runs[True]
    assert checked[0]["sft/kernel_check_passed"] == 1.0 and checked[0]["sft/kernel_check_loss_rel_diff"] < 1e-5
    assert not any(k.startswith("sft/kernel_check") for m in (checked[1], *plain) for k in m)
    assert [m["sft/grad_norm"] for m in checked] == [m["sft/grad_norm"] for m in plain]
    for k, v in w_checked.items():
        torch.testing.assert_close(v, w_plain[k], rtol=0, atol=0)


@pytest.mark.parametrize("candidate, what", [("scaled", "loss"), ("wrong_backward", "gradient norm"),
                                             ("nan", "loss")])
def test_sft_refuses_a_wrong_kernel_before_its_first_step(kernels, candidate, what):
    model = _model()
    before = _weights(model)
    backend = TorchBackend(model, lr=1e-2, total_steps=2, schedule="constant", attention_kernel=candidate,
                           kernel_check=True)
    with pytest.raises(AttentionKernelMismatch, match='model.attention_kernel = "segments"') as e:
        sft_update(backend, _rows(), micro_batch_size=2, pad_id=0)
    assert f"resolved to '{candidate}'" in str(e.value) and what in str(e.value)
    assert e.value.figures["sft/kernel_check_passed"] == 0.0
    if candidate == "wrong_backward":           # the forward is exact: only the gradients tell
        assert e.value.figures["sft/kernel_check_loss_rel_diff"] < 1e-6
        assert e.value.figures["sft/kernel_check_grad_rel_diff_attention"] > 0.1
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())
    assert all(p.grad is None for p in model.parameters())


def test_rl_refuses_a_wrong_kernel_and_reports_a_passing_check(kernels):
    trajs, adv = _trajectories(), [1.0, -1.0] * 3
    bad = TorchBackend(_model(), lr=1e-2, total_steps=2, schedule="constant", attention_kernel="wrong_backward",
                       kernel_check=True)
    with pytest.raises(AttentionKernelMismatch, match="model.attention_kernel"):
        rl_update(bad, trajs, adv, pad_id=0, micro_batch_size=3, prefix_len=4)
    good = TorchBackend(_model(), lr=1e-2, total_steps=2, schedule="constant", attention_kernel="dense",
                        kernel_check=True)
    m = rl_update(good, trajs, adv, pad_id=0, micro_batch_size=3, prefix_len=4)
    assert m["actor/kernel_check_passed"] == 1.0 and m["actor/kernel_check_grad_norm"] > 0
    assert m["actor/kernel_check_grad_norm_rel_diff"] < 1e-5 and not good.kernel_check_due
    merged = rl_merge([m, {**m, "actor/kernel_check_loss": -1.0}], [10.0, 10.0])
    assert merged["actor/kernel_check_loss"] == m["actor/kernel_check_loss"]        # rank 0's figures


def test_the_setting_reaches_the_backend_and_flex_is_refused_where_it_cannot_train():
    """`model.attention_kernel` travels config -> backend_options (the one mapping the local runtime, the Ray
    trainer shards and make_backend use) -> the backend, which the step bodies read it from; `flex` is
    refused at load for a CPU-only Ray cluster and at the trainer's start on a CPU, naming the field."""
    cfg = load_config("tiny", ['model.attention_kernel="segments"'])
    opts = backend_options(cfg.sft, cfg.model, total_steps=3, warmup_steps=0, schedule="constant")
    assert opts["attention_kernel"] == "segments"
    assert make_backend(_model(), cfg.sft, 3, 0, "constant", cfg.model).attention_kernel == "segments"
    flex = load_config("tiny", ['model.attention_kernel="flex"'])         # the local runtime: device unknown yet
    with pytest.raises(ValueError, match='model.attention_kernel = "flex" trains on CUDA'):
        make_backend(_model(), flex.sft, 3, 0, "constant", flex.model)
    cpu_ray = ['cluster.runtime="ray"', 'sft.backend="deepspeed"', 'rl.backend="deepspeed"', 'sandbox.backend="ray"']
    load_config("tiny", cpu_ray)
    with pytest.raises(ConfigError, match='model.attention_kernel = "flex" on a CPU-only cluster'):
        load_config("tiny", [*cpu_ray, 'model.attention_kernel="flex"'])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_under_deepspeed_the_check_leaves_the_step_unchanged(dist_env, kernels, stage, tmp_path):
    """ZeRO-2/3 hang gradient accumulation on parameter hooks: the check, which never accumulates, leaves the
    engine as it was (two steps after a check equal two steps without), and measures the same figures."""
    from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

    kw = {"lr": 1e-2, "total_steps": 4, "schedule": "constant", "zero_stage": stage, "attention_kernel": "dense"}
    runs, figures = [], []
    for due in (False, True):
        backend = DeepSpeedBackend(_model(), kernel_check=due, **kw)
        for _ in range(2):
            out = sft_update(backend, _rows(), micro_batch_size=2, pad_id=0)
            figures += [out] if "sft/kernel_check_passed" in out else []
        if stage == 3:
            backend.save_hf(tmp_path / f"z3-{due}")
            runs.append(_weights(Qwen2ForCausalLM.from_pretrained(tmp_path / f"z3-{due}")))
        else:
            runs.append(_weights(backend.model))
        backend.close()
    assert len(figures) == 1 and figures[0]["sft/kernel_check_passed"] == 1.0
    reference = compare_kernels(_model(), _mean_loss, reference="segments", candidate="dense")
    assert figures[0]["sft/kernel_check_grad_norm"] == pytest.approx(reference.grad_norm[1], rel=1e-5)
    for k, v in runs[1].items():
        torch.testing.assert_close(v, runs[0][k], rtol=0, atol=0)


def test_segments_layout_is_what_the_dense_reference_reads():
    seg = Segments(2, ((2, 5), (5, 7)), 9)
    q = torch.randn(1, 4, 9, 8)
    k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    want, _ = segment_attention_forward(None, q, k, v, None, segments=[seg])
    got, _ = _dense(None, q, k, v, None, segments=[seg])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
