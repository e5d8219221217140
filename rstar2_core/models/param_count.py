"""Parameters, bytes and shape of a decoder-only checkpoint from its `config.json` alone (no weights, no
torch): what `rstar2 plan` reports as the bytes of one weight push and sizes each GPU's memory from. Llama,
Qwen2 and Qwen3 layouts (tied or untied LM head, grouped KV heads, explicit head_dim, attention/MLP biases,
Qwen3's q/k norms; transformers' defaults for absent keys); exact for those
(tests/unit/models/test_param_count.py builds each and counts); another model type is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("llama", "qwen2", "qwen3")
ABSENT_KV_HEADS = {"llama": None, "qwen2": 32, "qwen3": 32}
"""transformers' defaults when config.json has no `num_key_value_heads` (Qwen3's `head_dim`: 128)."""


@dataclass(frozen=True)
class ModelShape:
    """What memory and traffic estimates need of a decoder: sizes from config.json, parameters counted."""

    kind: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    layer_params: int
    """Parameters of one decoder layer (attention, MLP, its two norms)."""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embedding_params * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module holds: what ZeRO-3 gathers at once (the embedding or LM head,
        or a layer's MLP in models with a small vocabulary)."""
        return max(self.embedding_params, 3 * self.hidden * self.intermediate)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token holds across all layers (keys and values)."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


def model_shape(cfg: dict[str, Any]) -> ModelShape:
    """The shape of the model `cfg` (an HF `config.json` as a dict) describes."""
    cfg = cfg.get("text_config", cfg)
    kind = cfg.get("model_type")
    if kind not in LAYOUTS:
        raise ValueError(f"param_count: model_type {kind!r} is not one of {list(LAYOUTS)}")
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
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
    tied = bool(cfg.get("tie_word_embeddings", False))       # what transformers assumes when the key is absent
    return ModelShape(kind, cfg["vocab_size"], h, cfg["num_hidden_layers"], inter, heads, kv, hd, tied,
                      attn + mlp + 2 * h)


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the model `cfg` (an HF `config.json` as a dict) describes."""
    return model_shape(cfg).params


def param_bytes(cfg: dict[str, Any], dtype: str) -> int:
    """Bytes of those parameters in `dtype` (the trainer's: what a push sends)."""
    return param_count(cfg) * DTYPE_BYTES[dtype]
