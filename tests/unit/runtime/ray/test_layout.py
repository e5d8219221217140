"""Actor layout from the config (pure logic): the 64-GPU production layout, separate GPUs, CPU-only, and
the errors that name the field to change."""

from __future__ import annotations

from collections import Counter

import pytest

from rstar2_core.config import ConfigError, load_config
from rstar2_core.runtime.layout import (
    LayoutError,
    NodeResources,
    driver_conflicts,
    fit_layout,
)
from rstar2_core.runtime.specs import layout_for

RAY_POOL = ['sandbox.backend="ray"', "sandbox.service={}"]   # the actor pool on the GPU nodes, not the tool service


def test_production_layout_uses_64_gpus_colocated():
    cfg = load_config("qwen3-14b-mi300x")
    lay = layout_for(cfg)
    assert (lay.nodes, lay.gpus_per_node, lay.total_gpus) == (8, 8, 64)
    assert len(lay.placement_groups) == 8 and all(pg.strategy == "STRICT_PACK" for pg in lay.placement_groups)
    assert [pg.gpus for pg in lay.placement_groups] == [8] * 8
    assert len(lay.engines) == 32 and {e.tp for e in lay.engines} == {2}
    assert len(lay.trainer_shards) == 64 and [t.rank for t in lay.trainer_shards] == list(range(64))
    # every GPU bundle carries exactly one engine TP rank and one trainer shard, sharing the GPU
    eng_use = Counter((e.node, b) for e in lay.engines for b in e.bundle_indices)
    tr_use = Counter((t.node, t.bundle_index) for t in lay.trainer_shards)
    gpu_bundles = {(pg.node, i) for pg in lay.placement_groups for i, b in enumerate(pg.bundles) if b.gpus}
    assert set(eng_use) == set(tr_use) == gpu_bundles and len(gpu_bundles) == 64
    assert max(eng_use.values()) == max(tr_use.values()) == 1
    assert all(e.gpu_fraction + t.gpu_fraction <= 1.0 for e in lay.engines for t in lay.trainer_shards)
    # TP ranks of an engine are consecutive bundles of one node
    for e in lay.engines:
        assert list(e.bundle_indices) == list(range(e.bundle_indices[0], e.bundle_indices[0] + 2))
        assert e.bundle_indices[-1] < 8
    # the sandbox is the tool service on its own nodes: the GPU nodes' groups hold GPU bundles only
    assert lay.sandbox_actors == ()
    for pg in lay.placement_groups:
        assert [b.role for b in pg.bundles] == ["gpu"] * 8 and pg.cpus == 16
        assert pg.bundles[0].resources() == {"CPU": 2.0, "GPU": 1.0}
    text = "\n".join(lay.describe())
    assert "64 GPUs" in text and "32 engine(s) x TP 2" in text and "node 7" in text
    assert "no sandbox actors" in text


def test_the_ray_sandbox_pool_takes_the_gpu_nodes_free_cpus():
    """sandbox.backend = "ray" (the pool on the GPU nodes): one actor per node on the CPUs left after 8 GPUs
    x 2 CPUs and the RL driver's 8 CPUs."""
    lay = layout_for(load_config("qwen3-14b-mi300x", RAY_POOL))
    assert len(lay.sandbox_actors) == 8 and {s.cpus for s in lay.sandbox_actors} == {128 - 16 - 8}
    for pg in lay.placement_groups:
        assert pg.cpus + 8 <= 128
        assert pg.bundles[-1].role == "sandbox" and pg.bundles[-1].resources() == {"CPU": 104.0}


def test_production_profile_driver_holds_no_gpu_and_a_reservation_is_refused():
    cfg = load_config("qwen3-14b-mi300x")
    lay = layout_for(cfg)
    assert cfg.cluster.runtime == "ray" and cfg.cluster.resources["rl"].num_gpus == 0
    assert driver_conflicts(lay, cfg.cluster.resources.get("rl")) == []
    with pytest.raises(ConfigError, match=r"cluster.resources.rl.num_gpus = 0"):
        load_config("qwen3-14b-mi300x", ["cluster.resources.rl.num_gpus=8"])
    # the local runtime has no layout to starve: a GPU for the task that runs the stage in process is fine
    local = load_config("qwen3-14b-mi300x", ['cluster.runtime="local"', "cluster.resources.rl.num_gpus=8",
                                             'rollout.weight_sync="auto"'])
    assert local.cluster.resources["rl"].num_gpus == 8


def test_separate_layout_splits_gpus():
    cfg = load_config("qwen3-14b-mi300x", ["cluster.layout=\"separate\"", "cluster.trainer_gpus=32",
                                           "rollout.weight_sync=\"nccl\"",
                                           "rollout.num_engines=16", *RAY_POOL, "sandbox.ray_actors_per_node=4"])
    lay = layout_for(cfg)
    trainer = {(t.node, t.bundle_index) for t in lay.trainer_shards}
    engine = {(e.node, b) for e in lay.engines for b in e.bundle_indices}
    assert len(trainer) == 32 and len(engine) == 32 and not trainer & engine
    assert {t.node for t in lay.trainer_shards} == {0, 1, 2, 3} and {e.node for e in lay.engines} == {4, 5, 6, 7}
    assert {e.gpu_fraction for e in lay.engines} == {1.0}
    assert len(lay.sandbox_actors) == 32 and {s.cpus for s in lay.sandbox_actors} == {104 // 4}


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.num_engines=33"], "set rollout.num_engines = 32"),
    (["rollout.tensor_parallel_size=3", "rollout.num_engines=2"], "must divide cluster.gpus_per_node"),
    (["cluster.cpus_per_node=20"], "cluster.cpus_per_gpu"),
    ([*RAY_POOL, "sandbox.ray_actors_per_node=500"], "at most 104"),
    (["cluster.cpus_per_gpu=1"], "set cluster.cpus_per_gpu >= 2"),   # trainer shard + engine actor per bundle
    (["cluster.layout=\"separate\"", "cluster.trainer_gpus=31", "rollout.num_engines=16",
      "rollout.weight_sync=\"nccl\"", "rl.zero_hpz_partition_size=1"], "multiple of"),
])
def test_bad_layouts_name_the_fix(overrides, needle):
    with pytest.raises(LayoutError, match=needle.replace(".", r"\.")):
        layout_for(load_config("qwen3-14b-mi300x", overrides))


def test_cpu_only_layout_runs_engines_in_the_driver():
    lay = layout_for(load_config("tiny"))
    assert lay.total_gpus == 0 and lay.trainer_shards[0].bundle_index == -1
    assert all(e.bundle_indices == () for e in lay.engines)
    assert [b.resources() for b in lay.placement_groups[0].bundles] == [{"CPU": 1.0}]  # 2 CPUs - 1 driver
    with pytest.raises(ConfigError, match="the HF engine has no tensor parallelism"):
        load_config("tiny", ["rollout.tensor_parallel_size=2"])
    with pytest.raises(LayoutError, match="needs GPUs"):
        layout_for(load_config("tiny", ["rollout.tensor_parallel_size=2", 'rollout.engine="vllm"']))


@pytest.mark.parametrize("overrides", [
    [],
    ["rollout.tensor_parallel_size=1", "rollout.num_engines=64"],
    ['cluster.layout="separate"', "cluster.trainer_gpus=32", 'rollout.weight_sync="nccl"', "rollout.num_engines=16",
     "cluster.cpus_per_gpu=1"],                                      # one actor per bundle: 1 CPU is enough
])
def test_every_bundle_holds_the_cpus_its_actors_ask(overrides):
    """The CPUs the real option builders ask of each GPU bundle fit it (else Ray leaves one pending)."""
    from rstar2_core.runtime.ray.engine_actors import engine_actor_options
    from rstar2_core.runtime.ray.trainer_shards import trainer_shard_options

    lay = layout_for(load_config("qwen3-14b-mi300x", overrides))
    demand = Counter()
    for s in lay.trainer_shards:
        demand[(s.node, s.bundle_index)] += trainer_shard_options(s, None)["num_cpus"]
    for e in lay.engines:
        demand[(e.node, e.bundle_indices[0])] += engine_actor_options(e, None, "ipc")["num_cpus"]
    cap = {(pg.node, i): b.cpus for pg in lay.placement_groups for i, b in enumerate(pg.bundles)}
    assert demand and all(d <= cap[k] for k, d in demand.items())


# ------------------------------------------------------------------------- multi-node: fit and rules
REHEARSAL = ['cluster.runtime="ray"', "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.logical_gpus=true",
             "cluster.cpus_per_node=4", "rollout.num_engines=2", 'rl.backend="deepspeed"', 'sft.backend="deepspeed"',
             'sandbox.backend="ray"', "storage.shared_filesystem=true"]


def _node(nid: str, cpu: float, gpu: float = 0.0, free: dict | None = None, head: bool = False) -> NodeResources:
    total = {"CPU": cpu, **({"GPU": gpu} if gpu else {})}
    return NodeResources(nid * 8, "10.0.0.1", total, dict(free if free is not None else total), head)


def test_the_rehearsal_is_the_gpu_layout_computed_on_the_cpu():
    lay = layout_for(load_config("tiny", REHEARSAL))
    assert lay.device == "cpu" and [pg.gpus for pg in lay.placement_groups] == [1, 1]
    assert [(t.node, t.bundle_index) for t in lay.trainer_shards] == [(0, 0), (1, 0)]
    assert [(e.node, e.bundle_indices) for e in lay.engines] == [(0, (0,)), (1, (0,))]
    assert "1 logical GPU" in lay.describe()[0]
    assert layout_for(load_config("qwen3-14b-mi300x")).device == "cuda"


def test_fit_places_each_group_on_a_node_that_holds_it_whole():
    lay = layout_for(load_config("tiny", REHEARSAL))       # 2 groups of {GPU 1, CPU 3}
    head, w1, w2 = _node("h", 3, head=True), _node("a", 4, 1), _node("b", 4, 1)
    fit = fit_layout(lay, [head, w1, w2])
    assert fit.fits and fit.placement == {"rstar2-node0": w1.label, "rstar2-node1": w2.label}
    # one worker gone: the second group fits no node, and each node's shortfall is named
    short = fit_layout(lay, [head, w1])
    assert not short.fits and short.placement == {"rstar2-node0": w1.label}
    (p,) = short.problems
    assert "rstar2-node1 needs 1 GPU, 3 CPU on one node" in p
    assert f"{head.label} lacks 1 GPU" in p and f"{w1.label} lacks 1 GPU, 2 CPU" in p   # after rstar2-node0 took 3 of its 4
    # the resources are there but held: fits the totals, not what is free now
    busy = _node("b", 4, 1, free={"CPU": 4.0, "GPU": 0.0})
    assert fit_layout(lay, [head, w1, busy]).fits
    now = fit_layout(lay, [head, w1, busy], free_only=True)
    assert not now.fits and "no node has it free" in now.problems[0]
    # two small groups may share one big node (STRICT_PACK keeps each group whole, not apart)
    assert fit_layout(lay, [_node("big", 8, 2)]).fits


def test_multi_node_rules_name_the_field():
    bad = {
        "cluster.logical_gpus = true needs cluster.gpus_per_node > 0": ["cluster.logical_gpus=true"],
        "storage.shared_filesystem = true": [x for x in REHEARSAL if not x.startswith("storage.")],
        "rollout.tensor_parallel_size = 2 with cluster.logical_gpus": REHEARSAL + ['rollout.engine="vllm"',
                                                                                  "rollout.tensor_parallel_size=2",
                                                                                  "rollout.num_engines=1"],
        "model.dtype = \"bfloat16\" on a CPU-only cluster": REHEARSAL + ['model.dtype="bfloat16"'],
    }
    for needle, overrides in bad.items():
        with pytest.raises(ConfigError) as ei:
            load_config("tiny", overrides)
        assert needle in str(ei.value), (needle, str(ei.value))
    # S3 needs no declaration; nccl/ipc weight sync are refused on logical GPUs
    load_config("tiny", [x for x in REHEARSAL if not x.startswith("storage.")] + ['storage.root="s3://b/p"'])
    with pytest.raises(ConfigError, match="real GPUs"):
        load_config("tiny", REHEARSAL + ['rollout.engine="vllm"', 'rollout.weight_sync="ipc"'])
