"""Fixtures for the rollout tests (helpers and scripted doubles live in rollout_fakes.py)."""

from __future__ import annotations

import pytest
from rollout_fakes import build_tokenizer, tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def chat(tokenizer):
    from rstar2_core.chat import ChatFormat

    return ChatFormat(tokenizer)


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny_model(len(tokenizer))
