import json

import pytest

from rstar2_cli.main import main
from rstar2_core.config import ConfigError, available_profiles, load_config


def test_profiles_exist():
    assert {"tiny", "smol", "qwen3-14b-mi300x"} <= set(available_profiles())


def test_production_profile_has_the_papers_numbers():
    cfg = load_config("qwen3-14b-mi300x")
    assert [s.max_response_tokens for s in cfg.rl.stages] == [8192, 12288, 12288]
    assert [s.max_turns for s in cfg.rl.stages] == [10, 10, 15]
    assert [s.steps for s in cfg.rl.stages] == [300, 85, 125]
    assert cfg.rl.stages[2].dataset == "hard_subset" and cfg.rl.stages[2].reset_optimizer
    assert cfg.rl.prompts_per_step == 512
    assert cfg.rl.grpo.oversample * cfg.rl.grpo.group_size == 32 and cfg.rl.grpo.group_size == 16
    assert (cfg.rl.grpo.clip_low, cfg.rl.grpo.clip_high) == (0.2, 0.28)
    assert cfg.rl.lr == 1e-6 and cfg.rl.warmup_steps == 20 and cfg.rl.grad_clip == 1.0
    assert cfg.sft.lr == 5e-6 and cfg.sft.epochs == 3 and cfg.sft.batch_size == 128
    assert cfg.eval.k == 16 and cfg.eval.temperature == 0.6 and cfg.eval.max_turns == 30


def test_dotted_override_into_list():
    cfg = load_config("tiny", ["rl.stages.0.max_response_tokens=4096", "rl.grpo.positive_mode=lowest_penalty"])
    assert cfg.rl.stages[0].max_response_tokens == 4096
    assert cfg.rl.grpo.positive_mode == "lowest_penalty"


@pytest.mark.parametrize("override, needle", [
    ("rl.stages.0.max_response_tokens=-1", "rl.stages.0.max_response_tokens"),
    ("rl.grpo.positive_mode=best", "rl.grpo.positive_mode"),
    ("rl.grpo.clip_hgh=0.3", "rl.grpo.clip_hgh: unknown field"),
    ("sft.micro_batch_size=7", "multiple of micro_batch_size"),
    ("sft.max_tokens_per_micro_batch=512", "raise it to >= 1024"),
    ("rl.stages.9.steps=1", "indexes a list of 3 items"),
    ("rl.grpo.resample=none", "rl.grpo.oversample = 1"),
    ("nonsense", "section.field=value"),
])
def test_bad_values_name_the_field_and_the_fix(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value)


@pytest.mark.parametrize("name, needle", [
    ("sft", "rl.stages.1.name: 'sft' is a name the pipeline uses itself"),
    ("parent", "'parent' is a name the pipeline uses itself"),
    ("register", "'register' is a name the pipeline uses itself"),
    ("promotion", "'promotion' is a name the pipeline uses itself"),
    ("curate", "'curate' is a name the pipeline uses itself"),
    ("config", "'config' is a name the pipeline uses itself"),
    ("eval-sft", "shape of the key of a stage's evaluation"),
    ("rl-stage-1-hard-subset", "shape of the key of a stage's hard subset"),
    ("../x", "rl.stages.1.name: '../x' is not a stage name: use lower-case letters, digits and '-'"),
    ("a/b", "'a/b' is not a stage name"),
    ("Stage1", "'Stage1' is not a stage name"),
    ("-x", "'-x' is not a stage name"),
])
def test_rl_stage_names_that_would_collide_or_escape_are_refused(name, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f'rl.stages.1.name="{name}"'])
    assert needle in str(e.value)
    if "not a stage name" not in needle:
        assert "pick another name" in str(e.value) and "leave it unset for rl-stage-<n>" in str(e.value)
    assert [s.name for s in load_config("tiny", ['rl.stages.1.name="long-ctx-2"']).rl.stages] == [
        "rl-stage-1", "long-ctx-2", "rl-stage-3"]


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("does-not-exist")


def test_cli_config_show(capsys):
    assert main(["config", "show", "--profile", "qwen3-14b-mi300x"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["rl"]["stages"][1]["max_response_tokens"] == 12288
    assert main(["config", "show", "--set", "sft.lr=-1"]) == 2
    assert "sft.lr" in capsys.readouterr().err


@pytest.mark.parametrize("profile", ["tiny", "smol", "qwen3-14b-mi300x"])
def test_snapshot_round_trip_gives_an_identical_config(profile):
    from rstar2_core.config import canonical_json, config_digest, config_from_snapshot

    cfg = load_config(profile, ["rl.stages.1.steps=4"])
    tree = json.loads(canonical_json(cfg.model_dump(mode="json")))  # what the run store holds
    again = config_from_snapshot(tree, "test", config_digest(tree))
    assert again == cfg and again.model_dump(mode="json") == cfg.model_dump(mode="json")
    assert [s.name for s in again.rl.stages] == [s.name for s in cfg.rl.stages]
    assert config_digest(again.model_dump(mode="json")) == config_digest(tree)


def test_profile_storage_finds_the_store_of_a_profile_that_no_longer_validates(tmp_path, monkeypatch):
    from rstar2_core.config import profile_storage

    bad = tmp_path / "edited.toml"
    bad.write_text('[rl]\nlr = -1\n[storage]\nroot = "s3://b/p"\ns3_region = "eu-west-1"\n')
    root, section = profile_storage(str(bad))
    assert root == "s3://b/p" and section.s3_region == "eu-west-1"
    with pytest.raises(ConfigError, match="rl.lr"):
        load_config(str(bad))
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home"))
    assert profile_storage("tiny")[0] == (tmp_path / "home" / "artifacts").resolve().as_uri()
    with pytest.raises(ConfigError, match=r"storage\.s3_regoin: unknown field"):
        profile_storage("tiny", ["storage.s3_regoin=x"])


def test_cli_config_show_run_prints_the_snapshot(tmp_path, capsys):
    from tasks.run_config import write_snapshot
    from tasks.run_store import RunStore

    root = (tmp_path / "art").as_uri()
    cfg = load_config("tiny", ["rl.lr=2e-4"])
    rc = write_snapshot(RunStore.for_run(root, "abc"), cfg, "tiny", ["rl.lr=2e-4"])
    assert main(["config", "show", "--run", "abc", "--storage-root", root]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["digest"] == rc.digest and shown["config"]["rl"]["lr"] == 2e-4 and shown["overrides"] == ["rl.lr=2e-4"]
    assert main(["config", "show", "--run", "nope", "--storage-root", root]) == 2
    assert "no config snapshot" in capsys.readouterr().err
    assert main(["config", "show", "--run", "abc", "--storage-root", root, "--set", "rl.lr=1"]) == 2


def test_registry_keys_in_the_config_match_the_registries():
    """Each `Literal` of a registry-backed field lists exactly the registry's keys (the config cannot
    import the registries: rl/, data/ and models/ import the config)."""
    from typing import get_args

    from rstar2_cli.eval import _FILE_LAYOUTS
    from rstar2_core.config import BenchmarkConfig, GRPOConfig, RolloutConfig, SFTConfig, SourceConfig
    from rstar2_core.data.benchmarks import LAYOUT_FIELDS as BENCH_FIELDS
    from rstar2_core.data.benchmarks import LOADERS
    from rstar2_core.data.sources import ADAPTERS
    from rstar2_core.data.sources import LAYOUT_FIELDS as SOURCE_FIELDS
    from rstar2_core.models.schedules import SCHEDULES
    from rstar2_core.rl import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, RESAMPLERS
    from rstar2_core.rollout.scheduler import SCHEDULERS

    def keys(model, field):
        return set(get_args(model.model_fields[field].annotation))

    assert keys(GRPOConfig, "advantage_estimator") == set(ADVANTAGE_ESTIMATORS)
    assert keys(GRPOConfig, "policy_loss") == set(POLICY_LOSSES)
    assert keys(GRPOConfig, "resample") == set(RESAMPLERS)
    assert keys(SourceConfig, "layout") == set(ADAPTERS) == set(SOURCE_FIELDS)
    assert keys(BenchmarkConfig, "layout") == set(LOADERS) | {"synthetic"} == set(BENCH_FIELDS)
    assert sorted(LOADERS) == _FILE_LAYOUTS
    assert keys(SFTConfig, "schedule") == set(SCHEDULES)
    assert keys(RolloutConfig, "scheduler") == set(SCHEDULERS)


RAY_CPU = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"']


@pytest.mark.parametrize("profile, overrides, needle", [
    ("tiny", ["rollout.tensor_parallel_size=2"], "the HF engine has no tensor parallelism"),
    ("tiny", ["rollout.gpu_memory_utilization=0.5"], "applies to vLLM engines only"),
    ("tiny", ['rollout.weight_sync="object_store"'], "needs cluster.runtime = \"ray\""),
    ("tiny", ["cluster.trainer_ranks=2"], "the local runtime trains in one process"),
    ("tiny", ['rollout.weight_sync="checkpoint"', "rl.checkpoint_every=2"], "set rl.checkpoint_every = 1"),
    ("tiny", ['cluster.runtime="ray"'], 'set rl.backend = "deepspeed"'),
    ("tiny", RAY_CPU + ['rollout.weight_sync="state_dict"'], "the local runtime's in-process copy"),
    ("tiny", RAY_CPU + ['model.dtype="bfloat16"'], 'set model.dtype = "float32"'),
    ("tiny", RAY_CPU + ['rollout.weight_sync="nccl"'], "needs rollout.engine = \"vllm\""),
    ("tiny", ['rollout.engine="vllm"', "model.tiny.head_dim=16"], "cannot serve the tiny model's head size 16"),
    ("tiny", ['rollout.engine="vllm"', "model.tiny.head_dim=null", "model.tiny.num_heads=4"],
     "hidden_size 64 / num_heads 4"),
    ("tiny", RAY_CPU + ['rollout.engine="vllm"', "rollout.release_memory_during_training=true",
                        'cluster.layout="colocated"'], "exists on CUDA and ROCm only"),
    ("qwen3-14b-mi300x", ["cluster.resources.eval.num_gpus=8"], "cluster.resources.eval.num_gpus = 0"),
    ("qwen3-14b-mi300x", ['model.dtype="float32"'], 'the Ray runtime\'s ZeRO ranks train in bf16'),
    ("qwen3-14b-mi300x", ["rl.zero_hpz_partition_size=3"], "must divide cluster.gpus_per_node = 8"),
    ("qwen3-14b-mi300x", ['cluster.layout="separate"', "cluster.trainer_gpus=4", "rollout.num_engines=30",
                          'rollout.weight_sync="nccl"'], "must divide the trainer ranks (cluster.trainer_gpus = 4)"),
    ("qwen3-14b-mi300x", ["rl.zero_stage=2"], "ZeRO++ hpZ, a DeepSpeed ZeRO-3 feature"),
    ("qwen3-14b-mi300x", ['rollout.weight_sync="nccl"'], "use \"ipc\" with cluster.layout = \"colocated\""),
    ("qwen3-14b-mi300x", ['cluster.layout="separate"', "cluster.trainer_gpus=32", "rollout.num_engines=16"],
     "needs cluster.layout = \"colocated\""),
    ("qwen3-14b-mi300x", ["cluster.trainer_ranks=8"], "set cluster.trainer_ranks = 0"),
    ("qwen3-14b-mi300x", ['sandbox.backend="local"', "sandbox.service={}"],
     'or calls the tool service on CPU nodes of its own'),
    ("qwen3-14b-mi300x", ['sandbox.backend="local"'], 'set sandbox.backend = \"service\" or remove the sandbox.service'),
    ("qwen3-14b-mi300x", ["sandbox.ray_actors_per_node=2"], 'applies to sandbox.backend = "ray" (the actor pool)'),
    ("tiny", ['sandbox.backend="service"', 'sandbox.service.connect="http"'], "needs sandbox.service.url"),
    ("qwen3-14b-mi300x", ["sandbox.service.max_replicas=8"], "max_replicas = 8 is below sandbox.service.replicas = 16"),
])
def test_settings_the_runtime_would_not_honour_are_refused(profile, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(profile, overrides)
    assert needle in str(e.value)


def test_a_kv_budget_below_one_response_is_refused_at_load_not_at_engine_start():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["rollout.kv_capacity_tokens=500"])
    assert "rollout.kv_capacity_tokens = 500 cannot hold one sequence of rl.stages.1.max_response_tokens = 512" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("qwen3-14b-mi300x", ["rollout.kv_capacity_tokens=20000"])
    assert "eval.max_tokens = 30000" in str(e.value)
    assert load_config("tiny", ["rollout.kv_capacity_tokens=2048"]).rollout.kv_capacity_tokens == 2048


def test_weight_sync_auto_resolves_per_runtime():
    from rstar2_core.config.runtime_rules import resolved_weight_sync

    assert resolved_weight_sync(load_config("tiny")) == "state_dict"
    assert resolved_weight_sync(load_config("tiny", RAY_CPU)) == "object_store"
    assert resolved_weight_sync(load_config("qwen3-14b-mi300x", ['rollout.weight_sync="auto"'])) == "ipc"
    sep = ['cluster.layout="separate"', "cluster.trainer_gpus=32", "rollout.num_engines=16", 'rollout.weight_sync="auto"']
    assert resolved_weight_sync(load_config("qwen3-14b-mi300x", sep)) == "nccl"


def test_group_affinity_with_the_static_scheduler_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="group_affinity applies to scheduler"):
        load_config("tiny", ['rollout.scheduler="static"', "rollout.group_affinity=true"])
    assert load_config("tiny", ["rollout.group_affinity=true"]).rollout.group_affinity is True


def test_settings_nothing_would_read_are_refused_at_load():
    with pytest.raises(ConfigError, match="unknown task kinds \\['evall'\\]"):
        load_config("tiny", ["cluster.resources.evall.num_cpus=1"])
    for section in ("rl", "sft"):
        with pytest.raises(ConfigError, match=f"{section}.zero_stage = 3 applies to {section}.backend"):
            load_config("tiny", [f"{section}.zero_stage=3"])
    assert load_config("tiny", ["rl.zero_stage=3", "rl.backend=deepspeed"]).rl.zero_stage == 3


def test_a_token_budget_must_hold_a_row_and_a_count_comes_back_with_null():
    cfg = load_config("qwen3-14b-mi300x")
    assert cfg.rl.max_tokens_per_micro_batch == cfg.sft.max_tokens_per_micro_batch == 16384
    with pytest.raises(ConfigError, match="raise it above 12288"):
        load_config("qwen3-14b-mi300x", ["rl.max_tokens_per_micro_batch=12288"])
    with pytest.raises(ConfigError, match="raise it to >= 8192"):
        load_config("qwen3-14b-mi300x", ["sft.max_tokens_per_micro_batch=8000"])
    back = load_config("qwen3-14b-mi300x", ["rl.micro_batch_size=4"])          # an override picks the cut
    assert back.rl.max_tokens_per_micro_batch is None and back.rl.micro_batch_size == 4
    again = load_config("tiny", ["rl.micro_batch_size=4", "rl.max_tokens_per_micro_batch=2048"])
    assert again.rl.micro_batch_size is None and again.rl.max_tokens_per_micro_batch == 2048
    with pytest.raises(ValueError, match="keep one in the profile"):                 # a file may not set both
        type(back.sft).model_validate({**back.sft.model_dump(), "micro_batch_size": 2})
