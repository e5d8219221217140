"""Sources and benchmarks read from s3:// through a local moto S3 server (127.0.0.1)."""

from pathlib import Path

import pytest

from rstar2_core import storage

FIX = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.mark.slow
def test_curate_from_and_to_s3(s3_endpoint):
    import boto3
    from data_fixtures import fixture_config

    from rstar2_core.data.curate import curate, read_dataset
    from rstar2_core.data.sources import read_source

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="rstar2")
    for name in ("dapo_math.jsonl", "aime24.jsonl"):
        storage.write_bytes_atomic(f"s3://rstar2/in/{name}", (FIX / name).read_bytes())
    r = read_source("s3://rstar2/in/dapo_math.jsonl", "dapo")
    assert r.name == "dapo_math" and len(r.candidates) == 6
    cfg = fixture_config()
    cfg.data.sources = [cfg.data.sources[0].model_copy(update={"url": "s3://rstar2/in/dapo_math.jsonl"})]
    cfg.eval.benchmarks = [cfg.eval.benchmarks[0].model_copy(update={"url": "s3://rstar2/in/aime24.jsonl"})]
    ref = curate(cfg, "s3://rstar2/datasets", progress=False)
    assert ref.url.startswith("s3://rstar2/datasets/") and ref.counts["decontamination"] == {"contaminated:aime24": 1}
    assert [row["id"] for row in read_dataset(ref.url)] == ["dapo/dapo-0000", "dapo/dapo-0001", "dapo/dapo-0002"]
    assert storage.read_json(ref.manifest_url)["n_rows"] == 3
