"""Parameters and bytes of a decoder-only checkpoint from its `config.json` alone (no weights, no torch):
what `rstar2 plan` reports as the bytes of one weight push. Llama, Qwen2 and Qwen3 layouts (tied or
untied LM head, grouped KV heads, explicit head_dim, attention/MLP biases, Qwen3's q/k norms; transformers'
defaults for absent keys); exact for those (tests/unit/models/test_param_count.py builds each and counts);
another model type is refused."""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("llama", "qwen2", "qwen3")
ABSENT_KV_HEADS = {"llama": None, "qwen2": 32, "qwen3": 32}
"""transformers' defaults when config.json has no `num_key_value_heads` (Qwen3's `head_dim`: 128)."""


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the model `cfg` (an HF `config.json` as a dict) describes."""
    cfg = cfg.get("text_config", cfg)
    kind = cfg.get("model_type")
    if kind not in LAYOUTS:
        raise ValueError(f"param_count: model_type {kind!r} is not one of {list(LAYOUTS)}")
    v, h, n_layers, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", ABSENT_KV_HEADS[kind]) or heads      # null: as many as the heads
    hd = cfg.get("head_dim", 128 if kind == "qwen3" else None) or h // heads
    q, k = heads * hd, kv * hd
    attn = h * q + 2 * h * k + q * h
    if kind == "qwen2":                                     # q, k and v carry biases
        attn += q + 2 * k
    elif cfg.get("attention_bias"):                         # Llama/Qwen3: all four projections
        attn += q + 2 * k + h
    if kind == "qwen3":
        attn += 2 * hd                                      # per-head RMSNorm of q and k
    mlp = 3 * h * inter + (2 * inter + h if kind == "llama" and cfg.get("mlp_bias") else 0)
    tied = cfg.get("tie_word_embeddings", False)              # what transformers assumes when the key is absent
    return v * h * (1 if tied else 2) + n_layers * (attn + mlp + 2 * h) + h


def param_bytes(cfg: dict[str, Any], dtype: str) -> int:
    """Bytes of those parameters in `dtype` (the trainer's: what a push sends)."""
    return param_count(cfg) * DTYPE_BYTES[dtype]
