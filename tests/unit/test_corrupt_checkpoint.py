"""A step checkpoint marked complete that lacks the state a resume needs fails the stage at once with
`CorruptCheckpoint` (a ValueError: the pipeline does not retry it, tasks/retry.py), naming the checkpoint and
the fix, before any engine or trainer starts; a storage error stays an OSError, which the pipeline retries."""

from __future__ import annotations

import json

import pytest

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.errors import CorruptCheckpoint
from rstar2_core.rl.stage import run_rl_stage
from rstar2_core.sft.train import run_sft


def _weights_only_step(out_url: str, step: int = 3) -> str:
    """A step checkpoint with its _COMPLETE marker but without the stage's state file (e.g. written by a
    hand copy, or by code that saved no state)."""
    url = storage.join(out_url, "steps", f"step-{step:06d}")
    with storage.staging_dir() as d:
        (d / "model.safetensors").write_bytes(b"")
        storage.write_dir_atomic(d, url, meta={"step": step})
    return url


def test_rl_stage_without_rl_state_in_its_step_checkpoint_is_corrupt_not_retryable(tmp_path):
    data = tmp_path / "rl.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "problem": f"{i}+1", "answer": str(i + 1)})
                              for i in range(4)))
    out = (tmp_path / "rl-stage-1").as_uri()
    ckpt = _weights_only_step(out)
    with pytest.raises(CorruptCheckpoint, match="has no RL trainer state .*; delete it") as e:
        run_rl_stage(load_config("tiny"), 0, init_checkpoint_url=(tmp_path / "nope").as_uri(),
                     data_url=data.as_uri(), out_url=out)
    assert ckpt in str(e.value) and isinstance(e.value, ValueError)
    from tasks.retry import is_infrastructure_error

    assert not is_infrastructure_error(e.value)


def test_sft_without_its_state_in_the_step_checkpoint_is_corrupt_not_retryable(tmp_path):
    out = (tmp_path / "sft").as_uri()
    ckpt = _weights_only_step(out)
    with pytest.raises(CorruptCheckpoint, match="has no SFT state .*; delete it") as e:
        run_sft(load_config("tiny"), base_model_url=(tmp_path / "nope").as_uri(),
                sft_data_url=(tmp_path / "nope.jsonl").as_uri(), out_url=out)
    assert ckpt in str(e.value)
    from tasks.retry import is_infrastructure_error

    assert not is_infrastructure_error(e.value)
