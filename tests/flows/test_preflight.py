"""The recipe's preflight on the production profile, its stores empty and its services down: one error, in
seconds, naming every input the run would read (RL and SFT sources, benchmarks, the base model), the
storage root it would write, the MLflow server and the Ray head, each with the setting that points at it
(tasks/recipe.py `preflight`). Against a real S3 API (moto) and real closed ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_server import moto_s3

from rstar2_core.config import ConfigError, load_config
from tasks.recipe import preflight

REGION = "eu-west-1"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]            # nothing listens there once the socket is closed


def test_preflight_names_every_missing_input_and_every_dead_endpoint():
    with moto_s3("rstar2-artifacts", REGION) as s3:
        cfg = load_config("qwen3-14b-mi300x", [
            f'storage.s3_endpoint_url="{s3}"', f'storage.s3_region="{REGION}"',
            f'tracking.tracking_uri="http://127.0.0.1:{_closed_port()}"',
            f'cluster.ray_address="127.0.0.1:{_closed_port()}"',
            f'sandbox.service.url="http://127.0.0.1:{_closed_port()}/sandbox"'])
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
        took = time.monotonic() - t0
    msg = str(e.value)
    assert len(cfg.data.sft_sources) == 3                # function calling, instruction following, chat
    for i, src in enumerate(cfg.data.sources):
        assert f"data.sources.{i}.url = {src.url!r} does not exist" in msg
    for i, url in enumerate(cfg.data.sft_sources):
        assert f"data.sft_sources.{i} = {url!r} does not exist" in msg
    for i, b in enumerate(cfg.eval.benchmarks):
        assert f"eval.benchmarks.{i}.url = {b.url!r}" in msg
    assert "model.name_or_path = 's3://rstar2-models/Qwen3-14B-Base' is not a complete checkpoint" in msg
    assert "tracking.tracking_uri" in msg and "MLflow server does not answer" in msg
    assert "cluster.ray_address" in msg and "no Ray head answers" in msg
    assert "sandbox.service.url" in msg and "the tool service does not answer its health check" in msg
    assert "storage root" not in msg                     # the artifacts bucket exists: writable
    assert took < 120, took                              # a bound that only catches a hang on a dead endpoint


def test_an_empty_sft_set_is_refused_before_any_compute(tmp_path):
    cfg = load_config("tiny", ["data.synthetic.enabled=false", f'storage.root="{tmp_path.as_uri()}"',
                               f'data.sources=[{{url="{tmp_path}/none.jsonl", layout="generic", name="g"}}]'])
    with pytest.raises(ConfigError, match="the SFT set would be empty"):
        preflight(cfg)


def test_a_stopped_s3_server_is_named_once_without_waiting_on_each_object():
    """moto started, then stopped: its port is closed. Preflight names the endpoint and its setting once
    (each object check would otherwise wait out botocore's retries against it), with the other endpoints."""
    with moto_s3("rstar2-preflight-stopped", REGION) as s3:      # moto's buckets are per process: a new name
        pass
    cfg = load_config("qwen3-14b-mi300x", [f'storage.s3_endpoint_url="{s3}"', f'storage.s3_region="{REGION}"',
                                           f'tracking.tracking_uri="http://127.0.0.1:{_closed_port()}"'])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert f"storage.s3_endpoint_url = {s3!r}: the S3 endpoint does not answer" in msg
    assert "MLflow server does not answer" in msg
    assert "does not exist" not in msg and "is not writable" not in msg


def test_a_running_s3_server_that_refuses_anonymous_requests_is_an_answer():
    from tasks.recipe import s3_endpoint_problem

    with moto_s3("rstar2-preflight-running", REGION) as s3:
        assert s3_endpoint_problem(load_config("tiny", [f'storage.s3_endpoint_url="{s3}"'])) is None


@pytest.mark.parametrize("cmd", [["flows.client", "run", "rstar2/full-recipe"], ["flows.full_recipe"]])
def test_a_prefect_api_that_does_not_answer_is_named_in_one_line(cmd):
    """PREFECT_API_URL at a closed port: the client and the in-process recipe end in seconds with one line
    naming the API, not a client trace."""
    url = f"http://127.0.0.1:{_closed_port()}/api"
    r = subprocess.run([sys.executable, "-m", *cmd], env={**os.environ, "PREFECT_API_URL": url}, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert url.rstrip("/") in r.stderr and "does not answer" in r.stderr and "PREFECT_API_URL" in r.stderr, r.stderr



def test_a_profile_whose_gpus_run_out_of_memory_is_refused_with_the_setting_named():
    """Preflight sizes each GPU from the base model's config.json in the store (Qwen3-14B-Base's): the production
    profile fits; engines awake at 0.99 of the GPU do not, and the error names the setting."""
    import boto3

    qwen3 = (Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen3-14B-Base.config.json").read_bytes()
    with moto_s3("rstar2-models", REGION) as s3:          # moto's buckets are per process: a new name
        boto3.client("s3", endpoint_url=s3, region_name=REGION).put_object(Bucket="rstar2-models", Key="Qwen3-14B-Base/config.json", Body=qwen3)
        base = [f'storage.s3_endpoint_url="{s3}"', f'storage.s3_region="{REGION}"']
        errors = []
        for over in ([], ["rollout.gpu_memory_utilization=0.99"]):
            with pytest.raises(ConfigError) as e:       # the data and the services are missing in both
                preflight(load_config("qwen3-14b-mi300x", [*base, *over]))
            errors.append(str(e.value))
    fits, overflows = errors
    assert "data.sources.0.url" in fits and "GPU memory" not in fits
    assert "GPU memory: the update peak" in overflows and "rollout.gpu_memory_utilization <=" in overflows
