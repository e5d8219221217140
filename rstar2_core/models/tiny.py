"""The from-scratch tiny model: a Qwen2/Qwen3-architecture causal LM and a tokenizer trained on our corpus.

`build_tiny(cfg)` renders SFT demonstrations of the synthetic task through `ChatFormat` (with a
merge-free bootstrap tokenizer, so the corpus text is exactly what training and rollout will see),
trains a byte-level BPE of `cfg.model.tiny.vocab_size` on it, and builds the configured shape (tied
embeddings, eos = `<|im_end|>`, pad = `<|endoftext|>`), initialised from `cfg.seed`: `Qwen2ForCausalLM`
(head size = hidden / heads), or `Qwen3ForCausalLM` when `model.tiny.head_dim` is set (the tiny
profile: four heads of 32 over a 64-wide stream, the head size vLLM's CPU attention takes).

Departs from the paper (Qwen3-14B-Base): a ~0.2M-parameter model that learns the synthetic task on 2
CPU cores in minutes. See docs/models-and-sft.md, "The tiny model and its tokenizer".
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rstar2_core.chat.tokens import ENDOFTEXT, IM_END
from rstar2_core.config import Config, TinyModelConfig

TOKENIZER_CORPUS_DEMOS = 500
"""Demonstrations rendered for tokenizer training (BPE merges settle long before the full SFT set)."""


def tiny_model_config(shape: TinyModelConfig, tokenizer) -> Qwen2Config | Qwen3Config:
    """Qwen2 (head size = hidden / heads), or Qwen3 when `shape.head_dim` is set (its own head size and
    RMS-normed queries and keys)."""
    common = {
        "vocab_size": len(tokenizer), "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size, "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT), "use_cache": True}
    if shape.head_dim is not None:
        return Qwen3Config(head_dim=shape.head_dim, **common)
    return Qwen2Config(**common)


def build_tiny_model(shape: TinyModelConfig, tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    """Randomly initialised Qwen2ForCausalLM (float32) for `tokenizer`, deterministic under `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = tiny_model_config(shape, tokenizer)
        model = (Qwen3ForCausalLM if isinstance(config, Qwen3Config) else Qwen2ForCausalLM)(config)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def corpus_texts(cfg: Config, n: int = TOKENIZER_CORPUS_DEMOS) -> list[str]:
    """Synthetic SFT demonstrations rendered through ChatFormat as plain text (tokenizer corpus)."""
    from rstar2_core.chat import ChatFormat, render_tool_result
    from rstar2_core.data.synthetic import demo_options, execute_requests, sft_demonstrations
    from rstar2_core.models.tokenizer import bootstrap_tokenizer

    syn = cfg.data.synthetic
    demos = sft_demonstrations(syn.seed, min(n, max(syn.n_sft, 1)), syn.fail_first_share, **demo_options(syn),
                               execute=lambda reqs: execute_requests(reqs, cfg.sandbox),
                               render=lambda r: render_tool_result(
                                   r, cfg.rollout.tool_response_head_chars, cfg.rollout.tool_response_tail_chars,
                                   cfg.rollout.tool_response_max_chars, cfg.rollout.tool_response_timing))
    boot = bootstrap_tokenizer()
    chat = ChatFormat(boot)
    return [boot.decode(chat.render_trajectory(d.problem, d.turn_lists())[0]) for d in demos]


def build_tiny(cfg: Config) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """(model, tokenizer) of the `tiny` kind from `cfg.model.tiny`, `cfg.data.synthetic`, `cfg.seed`."""
    from rstar2_core.models.tokenizer import train_tokenizer

    tok = train_tokenizer(corpus_texts(cfg), cfg.model.tiny.vocab_size)
    return build_tiny_model(cfg.model.tiny, tok, seed=cfg.seed), tok
