"""Tiny model + trained tokenizer: ChatML template equals ChatFormat, HF folder round trip."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rstar2_core.chat import ChatFormat
from rstar2_core.chat.tokens import IM_END, IM_START
from rstar2_core.config import TinyModelConfig
from rstar2_core.data.synthetic import answer_text, generate_problems, reference_code, tool_call_text
from rstar2_core.models.io import save_checkpoint
from rstar2_core.models.tiny import build_tiny_model
from rstar2_core.models.tokenizer import bootstrap_tokenizer, train_tokenizer


def _turns(p):
    return [(f"\nCompute it.\n</reason>\n{tool_call_text(reference_code(p))}", [f"{p.answer}\n[t]"]),
            (f"<reason>\nThe output is {p.answer}.\n</reason>\n{answer_text(p.answer)}", None)]


@pytest.fixture(scope="module")
def tok():
    boot = bootstrap_tokenizer()
    chat = ChatFormat(boot)
    texts = [boot.decode(chat.render_trajectory(p.problem, _turns(p))[0]) for p in generate_problems(0, 60, "sft")]
    return train_tokenizer(texts, 400)


def test_vocab_specials_and_lossless_round_trip(tok):
    assert len(tok) == 400
    assert tok.eos_token == IM_END and tok.convert_tokens_to_ids(IM_START) < 3
    text = 'What is 12^345 mod 67? ünïcode \t {"code": "print(1)"}'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    digits = [tok.decode([i]) for i in tok.encode("98765", add_special_tokens=False)]
    assert digits == list("98765")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], 100)


def test_chat_template_renders_like_chatformat(tok):
    chat = ChatFormat(tok)
    p = generate_problems(0, 1, "eval")[0]
    msgs = [{"role": "user", "content": p.problem}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == chat.prompt_text(p.problem)
    turns = _turns(p)
    code = reference_code(p)
    full = msgs + [
        {"role": "assistant", "content": "<reason>\nCompute it.\n</reason>\n",
         "tool_calls": [{"type": "function", "function": {"name": "python_code_with_standard_io",
                                                          "arguments": {"code": code, "input": ""}}}]},
        {"role": "tool", "content": turns[0][1][0]},
        {"role": "assistant", "content": turns[1][0]}]
    rendered = tok.apply_chat_template(full, tokenize=False)
    assert rendered == tok.decode(chat.render_trajectory(p.problem, turns)[0])
    # two tool results merge into one user turn, and the next assistant turn is opened without <reason>
    two = full[:2] + [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    out = tok.apply_chat_template(two, tokenize=False, add_generation_prompt=True)
    assert out.endswith(chat.tool_response_text(["a", "b"]))


def test_tiny_model_saves_as_plain_hf_folder(tok, tmp_path):
    shape = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            vocab_size=400)
    m = build_tiny_model(shape, tok, seed=1)
    assert torch.equal(m.model.embed_tokens.weight, build_tiny_model(shape, tok, seed=1).model.embed_tokens.weight)
    assert m.config.eos_token_id == tok.convert_tokens_to_ids(IM_END) and m.config.vocab_size == len(tok)
    save_checkpoint(m, tok, (tmp_path / "base").as_uri())
    m2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    tok2 = AutoTokenizer.from_pretrained(str(tmp_path / "base"))
    assert type(m2).__name__ == "Qwen2ForCausalLM"
    ids = ChatFormat(tok2).prompt_ids("What is 2^10 mod 7?")
    assert ids == ChatFormat(tok).prompt_ids("What is 2^10 mod 7?")
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(m.eval()(x).logits, m2(x).logits, atol=1e-5)
