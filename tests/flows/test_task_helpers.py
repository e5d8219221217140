"""The pipeline's pure helpers: retry rule, run store (stage records, EvalReports, the config snapshot),
naming, flattening, resources."""

from __future__ import annotations

import pytest

from rstar2_core import storage
from rstar2_core.config import ConfigError, load_config
from rstar2_core.faults import InjectedFault
from rstar2_core.results import DatasetRef, StageResult
from tasks.context import stage_label
from tasks.retry import is_infrastructure_error
from tasks.run_store import RunStore
from tasks.runners import placement, ray_init_kwargs, resources, task_threads
from tasks.tracking import flatten, metric_key


def test_retry_rule_retries_infrastructure_only():
    import ray.exceptions as rex

    from rstar2_core.errors import CorruptCheckpoint, InfraFailureShareExceeded, StaleEngineWeights
    from rstar2_core.runtime.ray.errors import ActorFailure

    assert is_infrastructure_error(InjectedFault("x"))
    assert is_infrastructure_error(ActorFailure("trainer-1", "killed"))
    assert is_infrastructure_error(InfraFailureShareExceeded("60% of the step failed"))
    assert is_infrastructure_error(StaleEngineWeights("gap 0.3"))
    assert is_infrastructure_error(ConnectionResetError())
    assert is_infrastructure_error(OSError("disk"))
    # a storage hiccup (a read that failed, a file not there yet) is retried; a checkpoint marked complete
    # that lacks its trainer state is deterministic and fails at once
    assert is_infrastructure_error(FileNotFoundError("s3://b/runs/r/state/sft.json"))
    assert is_infrastructure_error(PermissionError("s3: 503 Slow Down"))
    assert not is_infrastructure_error(CorruptCheckpoint("step-000010 has no RL trainer state; delete it"))
    assert is_infrastructure_error(TimeoutError())
    # an S3 endpoint down or dropping connections, as s3fs lets botocore's errors through (no OSError)
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError
    assert is_infrastructure_error(EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b/k"))
    assert is_infrastructure_error(ConnectionClosedError(endpoint_url="http://127.0.0.1:9/b/k"))
    assert is_infrastructure_error(rex.WorkerCrashedError())
    assert not is_infrastructure_error(ConfigError("bad profile"))
    assert not is_infrastructure_error(ValueError("bad row"))
    assert not is_infrastructure_error(KeyError("answer"))
    assert not is_infrastructure_error(RuntimeError("a bug"))
    # an actor's error as Ray re-raises it in the caller: RayTaskError(<cause's class>), or a plain
    # RayTaskError where Ray cannot build that subclass: both are classed by the cause
    for cause, infra in ((ActorFailure("engine-0", "killed"), True), (CorruptCheckpoint("no state"), False),
                         (RuntimeError("a bug"), False)):
        wrapped = rex.RayTaskError("generate", "Traceback ...", cause)
        assert is_infrastructure_error(wrapped) == is_infrastructure_error(wrapped.as_instanceof_cause()) == infra


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


def test_the_production_profiles_store_layout_is_the_one_infra_readme_names():
    from tasks.nightly import _dir as nightly_dir

    prod = load_config("qwen3-14b-mi300x")
    assert RunStore.for_run(prod.resolved_storage_root(), "abc").root == "s3://rstar2-artifacts/runs/abc"
    assert nightly_dir(prod) == "s3://rstar2-artifacts/nightly"


def test_names_and_flattening():
    prod = load_config("qwen3-14b-mi300x")
    labels = [stage_label(prod, i) for i in range(len(prod.rl.stages))]
    assert labels[1] == "rl-stage-2 (12K, 10 turns)" and labels[0] == "rl-stage-1 (8K, 10 turns)"
    flat = flatten({"rl": {"stages": [{"steps": 6}], "betas": [0.9, 0.99]}, "x": None})
    assert flat == {"rl.stages.0.steps": "6", "rl.betas": "[0.9, 0.99]", "x": "None"}
    assert metric_key("eval/synthetic/pass@1") == "eval/synthetic/pass_at_1"


def test_resources_and_ray_settings():
    cfg = load_config("tiny", ["cluster.resources.rl.num_cpus=2", "cluster.resources.eval.num_gpus=1"])
    assert resources(cfg, "rl") == {"num_cpus": 2.0}
    assert resources(cfg, "eval") == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert resources(cfg, "curate") == {}
    assert (task_threads(cfg, "rl"), task_threads(cfg, "eval"), task_threads(cfg, "curate")) == (2, 1, 1)
    assert task_threads(load_config("tiny", ["cluster.use_ray=false", "cluster.resources={}"]), "rl") is None
    with pytest.raises(ValueError, match="unknown task kind"):
        resources(cfg, "nope")
    kw = ray_init_kwargs(cfg.cluster)
    assert kw["include_dashboard"] is False and kw["num_cpus"] == 2 and len(kw["_temp_dir"]) < 60
    remote = ray_init_kwargs(load_config("tiny", ["cluster.ray_address=ray://head:10001"]).cluster)
    assert "_temp_dir" not in remote and "env_vars" in remote["runtime_env"]
    from prefect_ray.context import RemoteOptionsContext

    with placement(cfg, "rl"):
        assert RemoteOptionsContext.get().current_remote_options == {"num_cpus": 2.0}
    assert RemoteOptionsContext.get().current_remote_options == {}


def test_resources_without_ray_are_refused():
    """Threads in the flow process take no per-task reservation: a profile's cluster.resources with
    cluster.use_ray = false is refused with the fix, not silently dropped."""
    with pytest.raises(ConfigError, match=r"cluster.resources sets per-task Ray reservations \(sft\).*"
                                          r"cluster.resources=\{\}"):
        load_config("tiny", ["cluster.use_ray=false"])


def test_progress_knows_the_dag_size():
    from flows.client import _parse_params, expected_tasks

    # curate, sft-data, base-model, sft, 3 RL stages, 1 hard subset, 4 evaluations, register
    assert expected_tasks({"profile": "tiny"}) == 13
    # the SFT checkpoint is evaluated whatever eval_stages says: it is the promotion baseline
    assert expected_tasks({"profile": "tiny", "overrides": ["pipeline.eval_stages=last"]}) == 11
    assert expected_tasks({"profile": "no-such-profile"}) is None
    assert _parse_params(['profile="tiny"', "k=3"], ["rl.lr=1e-5"]) == {
        "profile": "tiny", "k": 3, "overrides": ["rl.lr=1e-5"]}


def test_eval_report_round_trips_through_the_run_store_and_pickle(tmp_path):
    import pickle

    import stage_doubles

    from rstar2_core.eval.metrics import EvalReport

    store = RunStore.for_run(tmp_path.as_uri(), "r1")
    rep = stage_doubles.fixed_report("file:///ckpt", 0.35, ["synthetic", "aime24"], store.url("eval", "sft"))
    store.save("eval-sft", rep)
    back = store.load("eval-sft")
    assert isinstance(back, EvalReport) and back == rep
    assert back.pass1() == {"synthetic": 0.35, "aime24": 0.35}
    assert back.rows["aime24"][6].n_correct == 4 and back.rows["aime24"][7].n_correct == 0
    assert EvalReport.load(rep.json_url) == rep  # the report.json the registry tag points at
    assert pickle.loads(pickle.dumps(rep)) == rep  # what Ray does between tasks
    storage.remove(rep.json_url)
    assert store.load("eval-sft") is None  # the report it names is gone


def _profiles(tmp_path, monkeypatch):
    import shutil

    from rstar2_core.config import config_dir

    d = tmp_path / "configs"
    shutil.copytree(config_dir(), d)
    monkeypatch.setenv("RSTAR2_CONFIG_DIR", str(d))
    return d / "tiny.toml"


def test_config_snapshot_is_written_once_and_read_back_identical(tmp_path, monkeypatch):
    import json

    from rstar2_core.config import SnapshotError, config_digest
    from tasks.run_config import drift_notes, locate_store, read_snapshot, write_snapshot

    tiny = _profiles(tmp_path, monkeypatch)
    overrides = [f"storage.root={(tmp_path / 'art').as_uri()}", "rl.stages.0.steps=7"]
    store = locate_store("tiny", overrides, "r1")
    assert store.root == (tmp_path / "art").as_uri() + "/runs/r1" and read_snapshot(store) is None
    cfg = load_config("tiny", overrides)
    rc = write_snapshot(store, cfg, "tiny", overrides)
    assert rc.config == cfg and rc.digest == config_digest(cfg.model_dump(mode="json"))
    assert [s.name for s in rc.config.rl.stages] == ["rl-stage-1", "rl-stage-2", "rl-stage-3"]  # filled defaults
    assert read_snapshot(store).config == cfg and drift_notes(read_snapshot(store), "tiny", overrides) == []
    # written once: a second write keeps the first snapshot
    assert write_snapshot(store, load_config("tiny", overrides + ["rl.lr=1"]), "tiny", overrides).config == cfg
    # the profile edited on disk: the snapshot still reads the same, the drift is named field by field
    tiny.write_text(tiny.read_text().replace("lr = 3e-4", "lr = 1e-3"))
    again = read_snapshot(locate_store("tiny", overrides, "r1"))
    assert again.config == cfg and again.config.rl.lr == 3e-4
    notes = drift_notes(again, "tiny", overrides)
    assert len(notes) == 1 and "rl.lr: 0.0003 (run) vs 0.001 (now)" in notes[0]
    tiny.write_text(tiny.read_text().replace("k = 2", "k = 0"))  # no longer validates: still found and run
    assert read_snapshot(locate_store("tiny", overrides, "r1")).config == cfg
    assert "no longer validates" in drift_notes(again, "tiny", overrides)[0]
    # a snapshot written by code that had a field this code removed: refused, the field named
    rec = store.read_config_snapshot()
    old = json.loads(json.dumps(rec["config"]))
    old["eval"]["gate_pass1"] = 0.2
    storage.write_json_atomic(store.config_url(), {**rec, "config": old, "digest": config_digest(old)})
    with pytest.raises(SnapshotError, match=r"eval\.gate_pass1: not a field of this version of the code"):
        read_snapshot(store)
    # edited after writing (digest no longer matches): refused
    storage.write_json_atomic(store.config_url(), {**rec, "config": {**rec["config"], "seed": 5}})
    with pytest.raises(SnapshotError, match="does not match its digest"):
        read_snapshot(store)
    # a field the snapshot lacks (added to the code since) takes the default, and the retry says so
    del old["eval"]["gate_pass1"], old["eval"]["comparison_confidence"]
    storage.write_json_atomic(store.config_url(), {**rec, "config": old, "digest": config_digest(old)})
    gap = read_snapshot(store)
    assert gap.config.eval.comparison_confidence == 0.95
    assert any("eval.comparison_confidence" in n for n in drift_notes(gap, "tiny", overrides))


def _pipeline_keys_in_code() -> tuple[set[str], set[str]]:
    """Every literal name the pipeline keys a run's store, MLflow runs or evaluations by, read from tasks/ and
    flows/: the first argument of RunStore.save/load/record/tracking_id/set_tracking_id, the parts of
    RunStore.url after its folder (`state/config.json` -> "config"), the key of `_run_tracked`, the stage
    of `evaluate_checkpoint`, the keys of the `evals` dict and what is assigned to a variable `key`; and the
    f-string keys (`eval-{}`)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names: set[str] = set()
    templates: set[str] = set()

    def add(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value.removesuffix(".json"))
        elif isinstance(node, ast.JoinedStr):
            templates.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
                                  ).removesuffix(".json"))

    for path in sorted((root / "tasks").glob("*.py")) + sorted((root / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if attr in {"save", "load", "record", "tracking_id", "set_tracking_id"} and node.args:
                    add(node.args[0])
                elif attr == "url":
                    for a in node.args[1:]:
                        add(a)
                elif attr == "_run_tracked" and len(node.args) > 3:
                    add(node.args[3])        # _run_tracked(ctx, cfg, kind, key, ...)
                elif "evaluate_checkpoint" in ast.unparse(f) and len(node.args) > 1:
                    add(node.args[1])
                elif attr == "submit" and len(node.args) > 2 and ast.unparse(node.args[1]) == "'evaluate'":
                    add(node.args[2])
            elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "evals" for t in node.targets):
                if isinstance(node.value, ast.Dict):
                    for k in node.value.keys:
                        add(k)
            elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "key" for t in node.targets):
                add(node.value)  # key = f"eval-{stage}", then passed to _run_tracked
    return names, templates


def test_rl_stage_names_may_not_be_the_pipelines_own_keys():
    from rstar2_core.config.rl import DERIVED_KEY_PREFIXES, DERIVED_KEY_SUFFIXES, PIPELINE_KEYS

    names, templates = _pipeline_keys_in_code()
    assert {"sft", "parent", "register", "promotion", "curate", "config", "summary"} <= names  # the scan works
    assert names <= PIPELINE_KEYS, f"keys the pipeline uses that a stage could be named: {names - PIPELINE_KEYS}"
    # the keys derived from a stage name: `eval-{stage}`, `{stage}-hard-subset`; plain `{key}` forms are the
    # store's own methods
    derived = {t for t in templates if t != "{}"}
    assert derived == {p + "{}" for p in DERIVED_KEY_PREFIXES} | {"{}" + s for s in DERIVED_KEY_SUFFIXES}, derived


def test_stage_plot_panels_name_metrics_the_stages_emit(tmp_path):
    """Every panel the stage PNG puts first is a metric a stage emits: the RL step's (rollout metrics of
    build_step_batch merged with the update's actor metrics, as rl_step merges them), an evaluation's and
    curation's, each taken from a real call."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rstar2_core.config import GRPOConfig
    from rstar2_core.data.curate import curate
    from rstar2_core.eval.metrics import BenchmarkMetrics
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.rl.groups import build_step_batch
    from rstar2_core.rl.trainer import rl_update
    from rstar2_core.rollout.types import ToolCallRecord, Trajectory
    from tasks.tracking import _PLOT_FIRST

    def traj(i):
        return Trajectory(prompt_ids=(1, 2), response_ids=(3 + i, 4, 5), loss_mask=(1, 1, 1), logprobs=(0.0,) * 3,
                          response_text=str(i), tool_calls=(ToolCallRecord(name="python", status="ok", failed=False),),
                          n_turns=2, n_answer_blocks=1, finish="answer", truncated=False)

    sb = build_step_batch([[traj(i) for i in range(4)]], [[1.0, 0.0, 1.0, 0.0]],
                          GRPOConfig(group_size=4, oversample=1, resample="none"), seed=0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
    actor = rl_update(TorchBackend(model, lr=1e-3, total_steps=1, schedule="constant"), list(sb.trajectories),
                      list(sb.advantages), pad_id=0)
    rl = set(sb.metrics) | set(actor)
    evaluation = set(BenchmarkMetrics("synthetic", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0).as_metrics())
    from pathlib import Path

    fix = Path(__file__).resolve().parents[1] / "fixtures"
    cfg = load_config("tiny", [f'data.sources=[{{url="{fix}/generic.jsonl", layout="generic", name="g"}}]',
                               "data.synthetic.enabled=false", "data.label_check.enabled=false",
                               f'eval.benchmarks=[{{name="aime24", url="{fix}/aime24.jsonl", layout="aime"}}]'])
    curation: set[str] = set()
    curate(cfg, (tmp_path / "ds").as_uri(), log_metrics=lambda m, s: curation.update(m), progress=False)
    emitted = rl | evaluation | curation
    assert {"actor/pg_loss", "actor/grad_norm", "rollout/reward_mean"} <= rl  # a real step, not an empty one
    assert [k for k in _PLOT_FIRST if k not in emitted] == []
    assert "actor/pg_loss" in _PLOT_FIRST  # the policy loss is among the panels an RL stage's PNG shows


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_what_ray_cannot_unpickle_is_not_retried_and_the_log_names_it(capsys):
    """A class that does not round-trip pickle reaches the flow as Ray's `RaySystemError(<the deserializer's
    exception>, traceback)` (a returned value, ray/_private/serialization.py) or `UnserializableException`
    (a raised error, ray/exceptions.py): a defect a retry repeats, not infrastructure."""
    import pickle

    import ray.exceptions as rex
    from prefect.states import Failed

    from tasks.retry import retry_on_infrastructure_error

    with pytest.raises(TypeError) as unpickle:
        pickle.loads(pickle.dumps(_NeedsTwo(1, 2)))
    returned = rex.RaySystemError(unpickle.value, "Traceback (most recent call last): ...")
    raised = rex.UnserializableException("Traceback (most recent call last):\n  ...\n_NeedsTwo: 1 and 2\n")
    for err, names in ((returned, "missing 1 required positional argument"), (raised, "_NeedsTwo: 1 and 2")):
        assert not is_infrastructure_error(err)
        assert not retry_on_infrastructure_error(None, None, Failed(data=err))
        said = capsys.readouterr().err
        assert "not retried: Ray could not deserialize" in said and names in said, said
    # a system error given as text (a raylet gone), or another failure while reading the bytes, stays retried
    assert is_infrastructure_error(rex.RaySystemError("the raylet died"))
    assert is_infrastructure_error(rex.RaySystemError(ConnectionResetError("reading the object"), "Traceback ..."))
    assert is_infrastructure_error(rex.RaySystemError(MemoryError(), "Traceback ..."))
