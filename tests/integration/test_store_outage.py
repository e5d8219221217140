"""The object store goes away for 30 s while an RL stage writes a step checkpoint (issue #44): a real moto
S3 server behind an endpoint the test closes (connections refused, transfers in flight reset) and opens
again. Within `storage.outage_retry_s` the writes wait and the stage finishes as if nothing happened;
past it the stage fails with a retryable error and its retry resumes from the last complete checkpoint.
Either way every checkpoint that says it is complete reads back whole."""

from __future__ import annotations

import threading
import time

import pytest
from flaky_endpoint import FlakyEndpoint, in_front_of
from s3_server import moto_s3

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.models.io import load_model_and_tokenizer, read_meta
from rstar2_core.rl.checkpoint import read_rl_state
from rstar2_core.rl.stage import run_rl_stage
from rstar2_core.runtime.checkpoint import read_rank_state
from tasks.retry import is_infrastructure_error

pytestmark = pytest.mark.slow

REGION, BUCKET = "eu-west-1", "rstar2-outage"
OUTAGE_S = 30.0
OVERRIDES = ["rl.prompts_per_step=2", "rl.grpo.group_size=4", "rl.grpo.oversample=2", "rl.stages.0.steps=3",
             "rl.stages.0.max_response_tokens=120", "rl.stages.0.max_turns=2", "rl.micro_batch_size=8",
             "rl.checkpoint_every=1", "rl.keep_checkpoints=3", "rollout.max_batch_size=16", "sandbox.workers=2",
             "rl.temperature=0.6", "sandbox.timeout_s=30", "rl.require_update=false"]


class Outage:
    """Takes `endpoint` down for `seconds` right before the first store operation on a URL under `prefix`
    (storage's `_remote` wrapped: the outage meets the checkpoint's first write, whatever the machine's load)."""

    def __init__(self, endpoint: FlakyEndpoint, prefix: str, seconds: float, monkeypatch):
        self.endpoint, self.prefix, self.seconds = endpoint, prefix, seconds
        self.started = self.ended = None
        self._timer: threading.Timer | None = None
        real = storage._remote

        def remote(what, url, fn, **kw):
            if self.started is None and self.prefix in url:
                self.endpoint.down()
                self.started = time.monotonic()
                self._timer = threading.Timer(self.seconds, self._up)
                self._timer.daemon = True
                self._timer.start()
            return real(what, url, fn, **kw)

        monkeypatch.setattr(storage, "_remote", remote)

    def _up(self):
        self.ended = time.monotonic()
        self.endpoint.up()

    def close(self):
        if self._timer is not None:
            self._timer.cancel()
        self.endpoint.up()


@pytest.fixture(scope="module")
def moto_url():
    with moto_s3(BUCKET, REGION) as url:
        yield url


@pytest.fixture
def store(moto_url):
    with in_front_of(moto_url, REGION) as endpoint:
        yield endpoint


def _assert_complete_checkpoints_read_back(out_url: str) -> list[int]:
    """Every step checkpoint marked complete loads whole (weights, every rank's trainer state, the RL
    state); returns their steps."""
    steps = []
    for d in storage.list_dirs(storage.join(out_url, "steps")):
        if not storage.is_complete(d):
            continue
        model, _ = load_model_and_tokenizer(d)
        assert sum(p.numel() for p in model.parameters()) > 0
        assert read_rank_state(d, 0, 1) is not None, d
        state = read_rl_state(d)
        assert state is not None and state["step"] == read_meta(d)["step"], d
        steps.append(int(state["step"]))
    return steps


def test_a_30s_outage_while_a_step_checkpoint_is_written_is_waited_out(toy_policy, store, monkeypatch):
    ckpt, data, _ = toy_policy
    endpoint = store
    storage.configure_s3(endpoint.url, REGION, outage_retry_s=120)     # moto_s3 restores the settings on exit
    cfg = load_config("tiny", OVERRIDES)
    out = f"s3://{BUCKET}/waited/rl-stage-1"
    retries_before = storage.outage_retries()
    outage = Outage(endpoint, "waited/rl-stage-1/steps/step-000002/", OUTAGE_S, monkeypatch)
    logged: list[int] = []
    try:
        res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                           log_metrics=lambda m, s: logged.append(s))
    finally:
        outage.close()
    assert outage.started is not None and outage.ended is not None                   # the store was away 30 s
    assert storage.outage_retries() > retries_before                                # ... and the writes waited
    assert logged == [1, 2, 3] and storage.is_complete(res.checkpoint_url)
    assert _assert_complete_checkpoints_read_back(out) == [1, 2, 3]


def test_an_outage_longer_than_the_budget_fails_retryable_and_the_retry_resumes(toy_policy, store, monkeypatch):
    ckpt, data, _ = toy_policy
    endpoint = store
    storage.configure_s3(endpoint.url, REGION, outage_retry_s=5)
    cfg = load_config("tiny", OVERRIDES)
    out = f"s3://{BUCKET}/failed/rl-stage-1"
    outage = Outage(endpoint, "failed/rl-stage-1/steps/step-000002/", OUTAGE_S, monkeypatch)
    logged: list[int] = []
    try:
        with pytest.raises(Exception) as err:
            run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                         log_metrics=lambda m, s: logged.append(s))
        assert is_infrastructure_error(err.value), repr(err.value)          # Prefect retries the task
        assert "5 s" in str(err.value) or "outage_retry_s" in str(err.value), str(err.value)
    finally:
        outage.close()
    assert logged == [1]                                     # step 2's checkpoint never completed
    assert _assert_complete_checkpoints_read_back(out) == [1]
    resumed: list[int] = []
    res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                       log_metrics=lambda m, s: resumed.append(s))
    assert resumed == [2, 3] and storage.is_complete(res.checkpoint_url)
    assert _assert_complete_checkpoints_read_back(out) == [1, 2, 3]
