"""What `ObjectStoreSync` puts in Ray's object store is the state dict's own bytes: under ZeRO-1/2 the
parameters are views of one flat buffer, and a pickled view carries its whole storage (found by
bench/weight_sync.py: SmolLM2's 651 MB push grew the rank past 16 GB and Ray's memory monitor killed it)."""

from __future__ import annotations

import pickle

import torch

from rstar2_core.runtime.ray.trainer_shards import own_storage


def _flat_views(n: int = 20, each: int = 10_000) -> dict:
    flat = torch.randn(n * each)                          # what DeepSpeed's ZeRO-2 holds on the CPU
    return {f"layer{i}.weight": flat[i * each:(i + 1) * each].view(100, 100) for i in range(n)}


def test_each_tensor_is_put_with_its_own_bytes_only():
    state = _flat_views()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    as_views = len(pickle.dumps({k: v.detach().to("cpu") for k, v in state.items()}))
    own = own_storage(state)
    assert as_views > 15 * nbytes                         # the flat buffer once per tensor: the bug
    assert len(pickle.dumps(own)) < 1.1 * nbytes          # the fix: each tensor's own bytes
    assert all(torch.equal(own[k], state[k]) for k in state)
    assert all(own[k].untyped_storage().nbytes() == state[k].numel() * 4 for k in state)
