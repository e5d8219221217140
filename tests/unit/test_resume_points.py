"""Where a resumed stage starts logging again (`resumed_through`): the last step a resume does not repeat,
in the metrics' step numbering, read from the stage's checkpoints (RL: global steps across stages)."""

from __future__ import annotations

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.rl.stage import resumed_through as rl_resumed_through
from rstar2_core.sft.train import resumed_through as sft_resumed_through


def _ckpt(url: str, meta: dict | None = None, complete: bool = True) -> None:
    if not complete:
        storage.write_text_atomic(storage.join(url, "model.safetensors"), "")  # no _COMPLETE marker
        return
    with storage.staging_dir() as d:
        (d / "model.safetensors").write_bytes(b"")
        storage.write_dir_atomic(d, url, meta=meta or {})


def test_rl_resumes_after_its_newest_complete_step_checkpoint_in_global_steps(tmp_path):
    cfg = load_config("tiny", ["rl.stages.0.steps=20", "rl.stages.1.steps=30", "rl.checkpoint_every=10"])
    out = (tmp_path / "rl-stage-2").as_uri()
    assert rl_resumed_through(cfg, 1, out) is None  # nothing yet: a resume starts at the stage's first step
    _ckpt(storage.join(out, "steps", "step-000010"))
    _ckpt(storage.join(out, "steps", "step-000020"), complete=False)  # interrupted while being written
    assert rl_resumed_through(cfg, 1, out) == 20 + 10
    _ckpt(storage.join(out, "final"))
    assert rl_resumed_through(cfg, 1, out) == 20 + 30  # finished: a resume logs nothing


def test_sft_resumes_after_its_newest_complete_step_checkpoint(tmp_path):
    out = (tmp_path / "sft").as_uri()
    assert sft_resumed_through(out) is None
    _ckpt(storage.join(out, "steps", "step-000100"), {"step": 100})
    _ckpt(storage.join(out, "steps", "step-000200"), {"step": 200})
    assert sft_resumed_through(out) == 200
    _ckpt(storage.join(out, "final"), {"step": 257})
    assert sft_resumed_through(out) == 257
