"""`sft_update` reports the tokens its forward passes ran (`sft/computed_tokens`): a micro-batch of
shared-prefix rows counts the prefix once, rows run as they are count each row's, and a zero-weight padding
pass counts none (bench/gpu_check.py's MFU divides by this)."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rstar2_core.models.backend import TorchBackend
from rstar2_core.sft.packing import merge_shared_prefix, pack, prefix_length
from rstar2_core.sft.step import padding_row, sft_update


def _rows():
    prefix = list(range(3, 43))                                   # a 40-token shared "system turn"
    docs = [(prefix + [50 + i] * 12, [0] * 44 + [1] * 8) for i in range(6)]
    return pack(docs, 64, pad_id=0, prefix=prefix)               # 2 conversations a row


def test_computed_tokens_count_a_merged_prefix_once_and_padding_passes():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128))
    backend = TorchBackend(model, lr=1e-4, total_steps=10, warmup_steps=0, schedule="constant")
    rows = _rows()
    assert len(rows) == 3 and prefix_length(rows[0]) == 40
    m = sft_update(backend, rows, micro_batch_size=3, pad_id=0)
    assert m["sft/computed_tokens"] == merge_shared_prefix(rows).n_real == 40 + 6 * 12
    assert m["sft/real_tokens"] == sum(r.n_real for r in rows) == 3 * (40 + 2 * 12)
    plain = sft_update(backend, rows, micro_batch_size=3, pad_id=0, merge_prefix=False)
    assert plain["sft/computed_tokens"] == plain["sft/real_tokens"]
    padded = sft_update(backend, rows, micro_batch_size=3, pad_id=0, num_micro_batches=2)
    assert padding_row(0).n_real == 0 and padded["sft/computed_tokens"] == m["sft/computed_tokens"]
