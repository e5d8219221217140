"""`safetensors_chunks`: a state dict cut into safetensors messages of bounded size for vLLM's workers
(rstar2_core/rollout/vllm_engine.py; the engine side runs against vLLM's CPU build in tests/vllm/)."""

import torch
from safetensors.torch import load

from rstar2_core.rollout.vllm_engine import safetensors_chunks


def test_chunks_hold_every_tensor_once_within_the_budget_in_order():
    sd = {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate([100, 300, 50, 2000, 10, 10])}
    budget = 400 * 4                                            # bytes of tensors per chunk
    chunks = [load(b) for b in safetensors_chunks(sd, budget)]
    assert [set(c) for c in chunks] == [{"w0", "w1"}, {"w2"}, {"w3"}, {"w4", "w5"}]   # w3 alone: larger
    for c in chunks:
        assert len(c) == 1 or sum(v.numel() * 4 for v in c.values()) <= budget
    merged = {k: v for c in chunks for k, v in c.items()}
    assert merged.keys() == sd.keys() and all(torch.equal(merged[k], sd[k]) for k in sd)


def test_tied_tensors_are_sent_apart():
    emb = torch.randn(8, 4)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb}     # one storage, two names
    (chunk,) = [load(b) for b in safetensors_chunks(sd, 1 << 20)]
    assert torch.equal(chunk["lm_head.weight"], emb) and torch.equal(chunk["model.embed_tokens.weight"], emb)
