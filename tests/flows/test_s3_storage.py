"""The storage-heavy part of the tiny recipe against a local S3 API (moto server on 127.0.0.1): the real
curation, SFT-data and base-model stages write parquet, JSONL and an HF checkpoint to s3://, and the
pipeline keeps its run store (stage records, MLflow run ids) there too; SFT/RL/eval are the stage
doubles (they also publish their checkpoints to S3). A second flow run with the same run id reads
everything back from S3 and recomputes nothing."""

from __future__ import annotations

import pytest
import stage_doubles
from s3_server import moto_s3

from rstar2_core import storage
from rstar2_core.config import load_config
from tasks.run_store import RunStore

REGION = "eu-west-1"
BUCKET = "rstar2-e2e"


@pytest.fixture
def s3():
    with moto_s3(BUCKET, REGION) as endpoint:
        yield endpoint


@pytest.mark.slow
def test_recipe_storage_on_s3(state, s3, monkeypatch):
    from flows.full_recipe import full_recipe
    from rstar2_core.data.curate import curate
    from rstar2_core.models import prepare_base_model
    from rstar2_core.sft.data import build_sft_dataset
    from tasks import stages

    # the real, storage-heavy stages; the doubles for the rest
    for fn in (curate, build_sft_dataset, prepare_base_model):
        monkeypatch.setattr(stages, fn.__name__, fn)
    overrides = state.overrides + [f"storage.root=s3://{BUCKET}/rstar2", f"storage.s3_endpoint_url={s3}",
                                   f"storage.s3_region={REGION}", "data.synthetic.n_sft=16",
                                   "data.synthetic.n_rl=16", "data.synthetic.n_eval=8", "pipeline.eval_stages=last"]
    out = full_recipe(profile="tiny", overrides=overrides, run_id="s3run")
    assert out["registration"]["checkpoint_url"].startswith(f"s3://{BUCKET}/rstar2/runs/s3run/")
    cfg = load_config("tiny", overrides)
    store = RunStore.for_run(cfg.resolved_storage_root(), "s3run")
    curated, base = store.load("curate"), store.load("base-model")
    assert curated.url.startswith("s3://") and curated.n_rows > 0 and storage.exists(curated.url)
    assert storage.is_complete(base["checkpoint_url"]) and base["checkpoint_url"].startswith("s3://")
    n_calls = len(stage_doubles.calls())
    assert full_recipe(profile="tiny", overrides=overrides, run_id="s3run") == out
    assert len(stage_doubles.calls()) == n_calls  # everything was read back from S3
