"""bench/train_step.py counts attention calls (not estimates them): per segment with the segments kernel,
per layer with the flex kernel; its response-length mix is long-tailed as stated."""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("bench.train_step")   # a named module: FlexAttention's tracing looks it up


def test_attention_calls_are_counted_per_segment_and_per_layer():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    bench = _bench()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    trajs = bench.trajectories(5, 16, 6, 64, seed=0)
    cut = [[0, 1], [2, 3, 4]]
    assert bench.forward_calls(model, trajs, cut, 6, "segments") == 3 * ((1 + 2) + (1 + 3))   # prefix + spans
    assert bench.forward_calls(model, trajs, cut, 6, "flex") == 3 * 2                          # one per layer


def test_the_mix_is_long_tailed():
    lengths = _bench().response_lengths(2000, 1000, random.Random(0))
    at_cap = sum(1 for x in lengths if x == 1000) / 2000
    short = sum(1 for x in lengths if x <= 250) / 2000
    assert 0.08 < at_cap < 0.12 and 0.65 < short < 0.75
