"""The one-call-per-layer kernel (FlexAttention with a block mask from the segments) gives the per-segment
kernel's log-probs, at the tiny and the SmolLM2 head shapes (grouped-query), with and without a shared
prefix. CPU runs FlexAttention's forward only: the gradient check is bench/gpu_check.py's `flex_grads` on a GPU."""

import random
import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rstar2_core.models.backend import TorchBackend
from rstar2_core.models.packed_attention import resolve_kernel, segment_attention, training_kernel
from rstar2_core.rl.logprobs import batch_logprobs, collate
from rstar2_core.rollout.types import Trajectory
from rstar2_core.sft.packing import pack
from rstar2_core.sft.step import masked_token_loss

SHAPES = {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4},
          "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                      "num_key_value_heads": 3}}


def model(shape):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, num_hidden_layers=2, max_position_embeddings=512,
                                        **SHAPES[shape])).eval()


def trajectories(prefix, n=5, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = 40 if i == 0 else rng.randint(1, 12)
        prompt = list(prefix) + [rng.randrange(2, 128) for _ in range(rng.randint(1, 5))]
        out.append(Trajectory(tuple(prompt), tuple(rng.randrange(2, 128) for _ in range(r)), (1,) * r,
                              (0.0,) * r, "", (), 1, 1, "answer", False))
    return out


@pytest.mark.parametrize("shape", ["tiny", "smollm2"])
@pytest.mark.parametrize("prefix_len", [0, 7])
def test_flex_logprobs_equal_the_per_segment_kernel(shape, prefix_len):
    m = model(shape)
    batch = collate(trajectories(range(2, 2 + prefix_len)), 0, "cpu", prefix_len)
    assert batch.segments[0].prefix == prefix_len
    with torch.no_grad():
        want = batch_logprobs(m, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                     # eager FlexAttention's "use torch.compile"
            got = batch_logprobs(m, batch, kernel="flex")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_flex_sft_loss_equals_the_per_segment_kernel_with_padded_rows():
    from rstar2_core.sft.packing import collate as sft_collate

    prefix = list(range(2, 12))
    docs = [(prefix + [20 + i] * (3 + 2 * i), [0] * 10 + [1] * (3 + 2 * i)) for i in range(6)]
    rows = pack(docs, 40, pad_id=0, prefix=prefix)
    mb = sft_collate(rows, "cpu", torch.float32)               # several rows, padded, segment layouts
    m = model("smollm2")
    with torch.no_grad():
        want, n = masked_token_loss(m, mb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, n2 = masked_token_loss(m, mb, "flex")
    assert n == n2 and len(rows) > 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_the_device_picks_the_kernel_and_cpu_refuses_to_train_flex():
    assert resolve_kernel("auto", torch.device("cpu")) == "segments"
    assert resolve_kernel("auto", torch.device("cuda")) == "flex"
    assert resolve_kernel("segments", torch.device("cuda")) == "segments"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        resolve_kernel("dense", torch.device("cpu"))
    m = model("tiny").train()
    with segment_attention(m, "flex"):
        assert m.config._attn_implementation == "rstar2_flex_segments"
    with segment_attention(m):
        assert m.config._attn_implementation == "rstar2_segments"
    assert m.config._attn_implementation != "rstar2_segments"      # restored on the way out
    batch = collate(trajectories(()), 0, "cpu", 0)
    with pytest.raises(ValueError, match="trains on CUDA only"):
        batch_logprobs(m, batch, kernel="flex")


def test_a_trainer_on_the_cpu_refuses_the_flex_setting_naming_it():
    """`model.attention_kernel = "flex"` reaches the backend as a value; on the CPU it is refused at the
    trainer's start, naming the field, before any step (the flex kernel has no CPU backward)."""
    assert training_kernel("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ValueError, match='model.attention_kernel = "flex" trains on CUDA'):
        training_kernel("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match='model.attention_kernel = "flex" trains on CUDA'):
        TorchBackend(model("tiny"), lr=1e-3, total_steps=1, attention_kernel="flex")
    b = TorchBackend(model("tiny"), lr=1e-3, total_steps=1)
    assert (b.attention_kernel, b.kernel_check_due) == ("segments", False)   # auto on the CPU: no check due
