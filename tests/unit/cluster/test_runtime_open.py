"""RayRuntime's process-wide `_OPEN` lock: a constructor that fails after taking it releases it, so the
Prefect retry of the task in the same process does not wait forever. No Ray needed: the failures
happen before (or instead of) `ray.init`."""

from __future__ import annotations

import pytest

from rstar2_core.config import load_config

RAY = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"']


def _flaky_tokenizer(url):
    raise OSError(f"S3 503 SlowDown while reading {url}/tokenizer.json")


def _no_ray(cfg):
    raise ConnectionError("Ray head unreachable")


@pytest.mark.parametrize("where", ["tokenizer", "ensure_ray"])
def test_failed_constructor_releases_the_open_lock(monkeypatch, where):
    from rstar2_core.cluster import runtime as rtmod
    from rstar2_core.models import io

    if where == "tokenizer":
        monkeypatch.setattr(io, "load_tokenizer", _flaky_tokenizer)
        kwargs, err = {}, OSError
    else:
        monkeypatch.setattr(rtmod, "ensure_ray", _no_ray)
        kwargs, err = {"tokenizer": object()}, ConnectionError
    cfg = load_config("tiny", RAY)
    assert not rtmod._OPEN.locked()
    try:
        for _ in range(2):   # the retry in the same process fails the same way instead of blocking forever
            with pytest.raises(err):
                rtmod.RayRuntime(cfg, policy_url="s3://bucket/ckpt", engines=False, sandbox=False, grader=False,
                                 **kwargs)
            assert not rtmod._OPEN.locked(), "the failed constructor left _OPEN held"
    finally:
        if rtmod._OPEN.locked():     # a leak must fail this test, not hang the next runtime test
            rtmod._OPEN.release()
