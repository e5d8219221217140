"""`param_count` from a config.json equals the parameters of the model transformers builds from it."""

from __future__ import annotations

import json

import pytest

from rstar2_core.models.param_count import param_bytes, param_count

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("arch,extra", [
    ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}), ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}), ("qwen3", {"attention_bias": True}),
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
])
def test_the_count_is_the_built_models(arch, extra, tmp_path):
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[arch]
    config = getattr(transformers, f"{cls}Config")(**SMALL, **extra)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    model.save_pretrained(tmp_path)                                  # the config.json a checkpoint carries
    saved = json.loads((tmp_path / "config.json").read_text())
    assert param_count(saved) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_absent_keys_take_transformers_defaults(arch):
    """A hand-written config.json may leave out num_key_value_heads and head_dim: transformers fills them in
    (Qwen: 32 KV heads, Qwen3 head_dim 128; Llama: one KV head per head, hidden / heads)."""
    import transformers

    cls = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[arch]
    bare = {"model_type": arch, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 32, "mlp_bias": True}                   # mlp_bias: Llama's only
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**bare))
    assert param_count(bare) == sum(p.numel() for p in model.parameters())


def test_qwen3_14b_and_bytes():
    qwen3_14b = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408,
                 "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False}
    assert round(param_count(qwen3_14b) / 1e9, 2) == 14.77                   # the model card: 14.8B
    assert param_bytes(qwen3_14b, "bfloat16") == 2 * param_count(qwen3_14b)
    with pytest.raises(ValueError, match="model_type 'mixtral'"):
        param_count({"model_type": "mixtral"})
