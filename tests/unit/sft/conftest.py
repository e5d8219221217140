"""Shared fixtures of the SFT tests: a small tokenizer + model checkpoint and a small SFT JSONL built from
executed synthetic demonstrations (module-independent, built once per session)."""

import pytest
from sft_test_config import small_cfg


@pytest.fixture(scope="session")
def sft_assets(tmp_path_factory):
    """(base checkpoint URL, SFT JSONL URL, DatasetRef) for the SMALL config."""
    from rstar2_core.models import prepare_base_model
    from rstar2_core.sft.data import build_sft_dataset

    root = tmp_path_factory.mktemp("sft-assets")
    cfg = small_cfg()
    base = prepare_base_model(cfg, (root / "base").as_uri())
    ref = build_sft_dataset(cfg, (root / "sft.jsonl").as_uri())
    return base, ref.url, ref


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on 2 shared cores a second thread spin-waits behind other processes (measured
    3-8x slower under load), and equal thread counts keep the resume comparison bit-exact."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
