"""The real vLLM engine (its CPU build, installed by `make setup`) for the tests marked `vllm`.

`vllm_engine` is one engine per test session over the toy policy (tests/toy_policy.py: two heads of 32,
the head size vLLM's CPU attention takes), built with the NCCL weight-transfer backend configured so the
protocol tests can ask its workers what the pinned version refuses (no NCCL group is ever joined on
CPU). A test that changes its weights puts the toy policy's back before it returns. Tests that need the
engine inside a runtime (RL stages, evaluation, the deployment) build their own through the runtime,
which is what they test. Starting an engine costs ~30-50 s on 2 cores (three processes import vLLM).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test under tests/vllm is marked `vllm` (pytest ignores a `pytestmark` in a conftest). This hook
    sees the whole session's items, hence the path test; tryfirst, so that `-m` selects on the mark."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def toy_dir(toy_policy):
    from rstar2_core.models.io import local_checkpoint_dir

    return str(local_checkpoint_dir(toy_policy[0]))


@pytest.fixture(scope="session")
def vllm_engine(toy_dir):
    from rstar2_core.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(toy_dir, max_model_len=1024, max_num_seqs=16, dtype="float32", seed=0,
                        weight_transfer="nccl")
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def toy_model(toy_policy):
    """The toy policy as the trainer holds it (HF, float32, eval mode) and its ChatFormat."""
    from rstar2_core.chat import ChatFormat
    from rstar2_core.models.io import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(toy_policy[0])
    return model, ChatFormat(tok)
