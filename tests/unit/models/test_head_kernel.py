"""`model.head_kernel`: which computation `token_logprobs` takes, and `liger` refused where it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from rstar2_core.config import ModelConfig, SFTConfig
from rstar2_core.models import token_logprobs as tl
from rstar2_core.models.backend import make_backend


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))


def _fake_fused(calls):
    """Stands in for Liger's fused linear cross-entropy (same signature and result: per-token NLL)."""
    def fused(hidden, weight, targets, reduction="none"):
        calls.append(hidden.shape[0])
        return F.cross_entropy(hidden @ weight.T, targets, reduction=reduction)
    return fused


def test_liger_on_this_cpu_is_refused_naming_the_field_and_what_is_missing():
    with pytest.raises(ValueError) as e:
        make_backend(_model(), SFTConfig(lr=1e-3), total_steps=2, warmup_steps=0, schedule="constant",
                     model_cfg=ModelConfig(head_kernel="liger"))
    msg = str(e.value)
    assert 'model.head_kernel = "liger"' in msg and "not on a CUDA device" in msg and 'head_kernel = "auto"' in msg


def test_obstacles_name_bias_and_zero3(monkeypatch):
    monkeypatch.setattr(tl, "_liger", lambda: _fake_fused([]))
    assert tl.liger_obstacles(torch.nn.Linear(8, 4, bias=False), on_cuda=True, partitioned=False) == []
    assert tl.liger_obstacles(torch.nn.Linear(8, 4), on_cuda=True, partitioned=False) == ["the LM head has a bias"]
    assert any("ZeRO-3" in o for o in tl.liger_obstacles(torch.nn.Linear(8, 4, bias=False), True, True))
    monkeypatch.setattr(tl, "_liger", lambda: None)
    assert any("kernels` extra" in o for o in tl.liger_obstacles(torch.nn.Linear(8, 4, bias=False), True, False))


@pytest.mark.parametrize("mode, fused_calls", [("auto", 1), ("liger", 1), ("torch", 0)])
def test_the_mode_set_by_the_backend_decides_the_path(monkeypatch, mode, fused_calls):
    calls = []
    monkeypatch.setattr(tl, "_liger", lambda: _fake_fused(calls))
    # this CPU stands in for a CUDA device: the device is the only obstacle left
    monkeypatch.setattr(tl, "liger_obstacles", lambda head, on_cuda, partitioned: [])
    model = _model()
    make_backend(model, SFTConfig(lr=1e-3), total_steps=2, warmup_steps=0, schedule="constant",
                 model_cfg=ModelConfig(head_kernel=mode))
    hidden, targets = torch.randn(5, 32), torch.randint(0, 64, (5,))
    got = tl.token_logprobs(model, hidden, targets, temperature=0.7)
    assert len(calls) == fused_calls
    want = torch.log_softmax(model.get_output_embeddings()(hidden) / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_liger_that_stops_holding_after_the_backend_checked_raises(monkeypatch):
    model = _model()
    monkeypatch.setattr(tl, "liger_obstacles", lambda head, on_cuda, partitioned: [])
    tl.set_head_kernel(model, "liger")
    monkeypatch.undo()          # the real checks again: on this CPU, Liger cannot run
    with pytest.raises(RuntimeError, match="no longer holds"):
        tl.token_logprobs(model, torch.randn(3, 32), torch.randint(0, 64, (3,)))


def test_an_unconfigured_model_takes_auto_and_a_bad_mode_is_refused(monkeypatch):
    model = _model()                    # no backend set a mode on it
    hidden, targets = torch.randn(4, 32), torch.randint(0, 64, (4,))
    plain = tl.token_logprobs(model, hidden, targets)                   # on this CPU: the chunked path
    calls = []
    monkeypatch.setattr(tl, "_liger", lambda: _fake_fused(calls))
    monkeypatch.setattr(tl, "liger_obstacles", lambda head, on_cuda, partitioned: [])
    fused = tl.token_logprobs(model, hidden, targets)                   # where Liger can run, auto takes it
    assert calls == [4]
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not one of"):
        tl.set_head_kernel(model, "fused")
