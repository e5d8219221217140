"""The pipeline's pure helpers: retry rule, run store, naming, flattening, comparisons, resources."""

from __future__ import annotations

import pytest

from rstar2_core import storage
from rstar2_core.config import ConfigError, load_config
from rstar2_core.faults import InjectedFault
from rstar2_core.results import DatasetRef, StageResult
from tasks.context import stage_label
from tasks.evals import compare, comparison_markdown, pass1_by_benchmark
from tasks.retry import is_infrastructure_error
from tasks.run_store import RunStore
from tasks.runners import placement, ray_init_kwargs, resources
from tasks.tracking import flatten, metric_key


def test_retry_rule_retries_infrastructure_only():
    import ray.exceptions as rex

    assert is_infrastructure_error(InjectedFault("x"))
    assert is_infrastructure_error(ConnectionResetError())
    assert is_infrastructure_error(OSError("disk"))
    assert is_infrastructure_error(TimeoutError())
    assert is_infrastructure_error(rex.WorkerCrashedError())
    assert not is_infrastructure_error(ConfigError("bad profile"))
    assert not is_infrastructure_error(ValueError("bad row"))
    assert not is_infrastructure_error(KeyError("answer"))
    assert not is_infrastructure_error(RuntimeError("a bug"))


def test_run_store_returns_only_complete_results(tmp_path):
    store = RunStore.for_run(tmp_path.as_uri(), "r1")
    assert store.load("curate") is None
    ref = DatasetRef(url=store.url("data", "x.jsonl"), digest="ab", n_rows=2)
    store.save("curate", ref)
    assert store.load("curate") is None  # the dataset file it names is missing
    storage.write_text_atomic(ref.url, "{}\n{}\n")
    assert store.load("curate") == ref
    ckpt = store.url("checkpoints", "sft")
    store.save("sft", StageResult(name="sft", checkpoint_url=ckpt, steps=3), attempt=2)
    assert store.load("sft") is None  # no _COMPLETE marker
    with storage.staging_dir() as d:
        (d / "w").write_text("w")
        storage.write_dir_atomic(d, ckpt)
    assert store.load("sft").steps == 3 and store.record("sft")["attempt"] == 2
    store.set_tracking_id("sft", "abc")
    assert store.tracking_id("sft") == "abc" and store.tracking_id("parent") is None


def test_names_and_flattening():
    prod = load_config("qwen3-14b-mi300x")
    labels = [stage_label(prod, i) for i in range(len(prod.rl.stages))]
    assert labels[1] == "rl-stage-2 (12K, 10 turns)" and labels[0] == "rl-stage-1 (8K, 10 turns)"
    flat = flatten({"rl": {"stages": [{"steps": 6}], "betas": [0.9, 0.99]}, "x": None})
    assert flat == {"rl.stages.0.steps": "6", "rl.betas": "[0.9, 0.99]", "x": "None"}
    assert metric_key("eval/synthetic/pass@1") == "eval/synthetic/pass_at_1"


def test_regression_compare():
    rows = compare({"a": 0.5, "b": 0.5}, {"a": 0.47, "b": 0.49, "c": 0.1}, threshold=0.02)
    status = {r["benchmark"]: r["regression"] for r in rows}
    assert status == {"a": True, "b": False, "c": False}
    md = comparison_markdown(rows, 0.02, "nightly")
    assert "| a | 0.500 | 0.470 | -0.030 | REGRESSION |" in md and "| c | - | 0.100 | - | new |" in md
    assert pass1_by_benchmark({"benchmarks": {"s": {"pass1": 0.25}}}) == {"s": 0.25}
    with pytest.raises(ValueError, match="no per-benchmark pass@1"):
        pass1_by_benchmark({"other": 1})


def test_resources_and_ray_settings():
    cfg = load_config("tiny", ["cluster.resources.rl.num_cpus=2", "cluster.resources.eval.num_gpus=1"])
    assert resources(cfg, "rl") == {"num_cpus": 2.0}
    assert resources(cfg, "eval") == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert resources(cfg, "curate") == {}
    with pytest.raises(ValueError, match="unknown task kind"):
        resources(cfg, "nope")
    kw = ray_init_kwargs(cfg)
    assert kw["include_dashboard"] is False and kw["num_cpus"] == 2 and len(kw["_temp_dir"]) < 60
    remote = ray_init_kwargs(load_config("tiny", ["cluster.ray_address=ray://head:10001"]))
    assert "_temp_dir" not in remote and "env_vars" in remote["runtime_env"]
    from prefect_ray.context import RemoteOptionsContext

    with placement(cfg, "rl"):
        assert RemoteOptionsContext.get().current_remote_options == {"num_cpus": 2.0}
    assert RemoteOptionsContext.get().current_remote_options == {}


def test_progress_knows_the_dag_size():
    from flows.client import _parse_params, expected_tasks

    # curate, sft-data, base-model, sft, 3 RL stages, 1 hard subset, 4 evaluations, register
    assert expected_tasks({"profile": "tiny"}) == 13
    assert expected_tasks({"profile": "tiny", "overrides": ["pipeline.eval_stages=last"]}) == 10
    assert expected_tasks({"profile": "no-such-profile"}) is None
    assert _parse_params(['profile="tiny"', "k=3"], ["rl.lr=1e-5"]) == {
        "profile": "tiny", "k": 3, "overrides": ["rl.lr=1e-5"]}
