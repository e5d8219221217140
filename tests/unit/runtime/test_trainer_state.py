"""Per-rank trainer state in checkpoints: each rank's file round-trips, another world size is refused with
the message a user needs, and pre-seam checkpoints (one backend state in rl_state.pt) still load at world 1."""

from __future__ import annotations

import io

import pytest
import torch

from rstar2_core import storage
from rstar2_core.runtime.checkpoint import read_rank_state, saved_world_size, write_rank_state


def test_each_rank_reads_back_its_own_state(tmp_path):
    url = tmp_path.as_uri()
    for r in range(2):
        write_rank_state(url, r, 2, {"step": 7, "rank_marker": r})
    assert saved_world_size(url) == 2
    assert read_rank_state(url, 1, 2) == {"step": 7, "rank_marker": 1}
    assert read_rank_state(url, 0, 2)["rank_marker"] == 0


def test_another_world_size_is_refused_naming_the_fix(tmp_path):
    url = tmp_path.as_uri()
    for r in range(2):
        write_rank_state(url, r, 2, {"step": 1})
    with pytest.raises(ValueError, match=r"2 rank\(s\) but this runtime has 4.*same world size"):
        read_rank_state(url, 0, 4)


def test_a_checkpoint_without_trainer_state_gives_none_and_legacy_state_loads_at_world_1(tmp_path):
    assert read_rank_state(tmp_path.as_uri(), 0, 1) is None        # e.g. an SFT final (weights only)
    buf = io.BytesIO()
    torch.save({"step": 3, "backend": {"step": 3, "optimizer": {}}}, buf)
    storage.write_bytes_atomic(storage.join(tmp_path.as_uri(), "rl_state.pt"), buf.getvalue())
    assert read_rank_state(tmp_path.as_uri(), 0, 1) == {"step": 3, "optimizer": {}}
    assert read_rank_state(tmp_path.as_uri(), 0, 2) is None


def test_rank_state_reaches_an_s3_store_through_a_file_and_reads_back():
    """A rank's state is streamed from a local file (no in-memory copy of the partition), to S3 too."""
    import torch
    from s3_server import moto_s3

    from rstar2_core import storage

    with moto_s3("rstar2-rank-state", "eu-west-1") as endpoint:
        storage.configure_s3(endpoint, "eu-west-1")              # moto_s3 restores the settings on exit
        url = "s3://rstar2-rank-state/ckpt/step-000001"
        big = torch.arange(300_000, dtype=torch.float32)          # ~1.2 MB, a tensor like an Adam moment
        n = write_rank_state(url, 0, 1, {"step": 1, "exp_avg": big})
        back = read_rank_state(url, 0, 1)
        assert n > big.numel() * 4 and back["step"] == 1 and torch.equal(back["exp_avg"], big)
