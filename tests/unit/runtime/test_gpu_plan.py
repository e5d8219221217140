"""The GPU plan of a profile (runtime/gpu_memory.py, runtime/collectives.py, runtime/cluster_plan.py): each
GPU's memory by part and each trainer rank's traffic, from Qwen3-14B-Base's config.json and the production
profile; a profile that does not fit is refused with the setting named; what cannot be checked says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rstar2_core.config import load_config
from rstar2_core.models.param_count import model_shape
from rstar2_core.runtime.cluster_plan import gpu_plan
from rstar2_core.runtime.collectives import step_traffic
from rstar2_core.runtime.gpu_memory import GIB, TrainerSetting, activations, trainer_update, zero_states
from rstar2_core.runtime.specs import gpu_plan_sections

QWEN3_14B = json.loads((Path(__file__).resolve().parents[3] / "configs" / "models" /
                        "Qwen3-14B-Base.config.json").read_text())
SHAPE = model_shape(QWEN3_14B)


def _of(cfg, hf: dict | None, source: str = "test") -> dict:
    return gpu_plan(**gpu_plan_sections(cfg), hf=hf, source=source)


def _plan(*overrides: str) -> dict:
    return _of(load_config("qwen3-14b-mi300x", list(overrides)), QWEN3_14B)


def test_the_production_profile_fits_and_every_part_is_there():
    plan = _plan()
    mem = plan["gpu_memory"]
    assert plan["problems"] == []
    assert mem["device_gb"] == 192 and mem["update_peak_gb"] <= 192 and mem["rollout_peak_gb"] <= 192
    parts = mem["parts"]
    for key in ("rollout.engine_weights", "rollout.engine_kv_cache", "rollout.weight_push_bucket",
                "rollout.trainer_optimizer", "update.engine_awake", "update.trainer_params", "update.trainer_grads",
                "update.trainer_optimizer", "update.trainer_master_params", "update.trainer_gathered_params",
                "update.trainer_activations_checkpointed", "update.trainer_activations_recompute",
                "update.trainer_logits_chunk", "update.trainer_context", "update.trainer_collective_buffers",
                "update.trainer_allocator_fragmentation", "update.trainer_hpz_secondary_params", "sft.trainer_params"):
        assert parts[key] > 0, key
    # the engine's share is all-in: weights (1/TP of 29.5 GB) + KV + the rest = 0.75 x 192
    engine = sum(v for k, v in parts.items() if k.startswith("rollout.engine"))
    assert engine == pytest.approx(0.75 * 192, abs=0.01) and parts["update.engine_awake"] == pytest.approx(engine, abs=0.01)
    assert parts["rollout.engine_weights"] == pytest.approx(SHAPE.params * 2 / 2 / GIB, abs=0.01)
    # a peak is the sum of its phase's parts
    assert mem["update_peak_gb"] == pytest.approx(sum(v for k, v in parts.items() if k.startswith("update.")), abs=0.05)


def test_engines_awake_at_099_are_refused_naming_the_setting():
    plan = _plan("rollout.gpu_memory_utilization=0.99")
    (roll, upd) = plan["problems"]
    assert "rollout peak" in roll and "rollout.gpu_memory_utilization <=" in roll and "engine_kv_cache" in roll
    assert "update peak" in upd and "update.engine_awake" in upd and "release_memory_during_training" in upd


def test_sleeping_engines_give_the_trainer_the_gpu():
    awake, asleep = _plan("rollout.gpu_memory_utilization=0.9"), _plan("rollout.gpu_memory_utilization=0.9",
                                                                         "rollout.release_memory_during_training=true")
    assert any("update peak" in p for p in awake["problems"])
    assert asleep["problems"] == [] and "update.engine_asleep" in asleep["gpu_memory"]["parts"]
    assert asleep["gpu_memory"]["update_peak_gb"] < awake["gpu_memory"]["update_peak_gb"] - 100


def test_a_token_budget_too_large_for_the_trainer_is_refused_with_the_budget_named():
    plan = _plan("rl.max_tokens_per_micro_batch=131072", "model.gradient_checkpointing=false")
    (upd,) = plan["problems"]
    assert "rl.max_tokens_per_micro_batch" in upd and "model.gradient_checkpointing = true" in upd
    assert "update.trainer_activations" in upd


def test_zero_states_follow_the_stage():
    p = SHAPE.params
    z3 = zero_states(SHAPE, zero_stage=3, world=64, bf16=True)
    assert z3 == {"params": 2 * p / 64, "grads": 4 * p / 64, "optimizer": 8 * p / 64, "master_params": 4 * p / 64}
    z0 = zero_states(SHAPE, zero_stage=0, world=64, bf16=False)
    assert z0 == {"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p, "master_params": 0.0}
    assert zero_states(SHAPE, zero_stage=3, world=64, bf16=True, hpz=8)["hpz_secondary_params"] == 2 * p / 8
    # checkpointing keeps one layer's activations, not all of them
    full = activations(SHAPE, 16384, checkpointing=False, dtype_bytes=2)["activations"]
    ckpt = sum(activations(SHAPE, 16384, checkpointing=True, dtype_bytes=2).values())
    assert ckpt < full / 5
    cpu = trainer_update(SHAPE, tokens=1024, zero_stage=3, world=2, bf16=False, hpz=1, checkpointing=True,
                         contexts=False)
    assert "trainer_context" not in cpu and "collective_buffers" not in cpu


def test_what_cannot_be_checked_says_why():
    cfg = load_config("qwen3-14b-mi300x")
    assert "read-model" in _of(cfg, None, "not read: `rstar2 plan --read-model` ...")["gpu_memory"]["skipped"]
    cases = {"logical GPUs": ["cluster.logical_gpus=true", 'model.dtype="float32"', "rollout.tensor_parallel_size=1",
                              "rollout.gpu_memory_utilization=null", 'rollout.weight_sync="object_store"',
                              "rl.zero_hpz_partition_size=1"],
             "cluster.gpu_memory_gb is not set": ["cluster.gpu_memory_gb=null"]}
    for why, over in cases.items():
        plan = _of(load_config("qwen3-14b-mi300x", over), QWEN3_14B)
        assert why in plan["gpu_memory"]["skipped"] and plan["problems"] == []
    assert "no GPUs" in _of(load_config("tiny"), QWEN3_14B)["gpu_memory"]["skipped"]
    odd = {**QWEN3_14B, "model_type": "mistral"}
    assert "cannot be sized" in _of(cfg, odd)["gpu_memory"]["skipped"]


def test_hpz_keeps_all_but_one_gather_per_step_inside_the_node():
    tr = TrainerSetting(zero_stage=3, hpz=8, tokens=16384, tokens_field="rl.max_tokens_per_micro_batch")
    kw = {"tokens_per_step": 64 * 16384 * 10, "world": 64, "gpus_per_node": 8, "dtype": "bfloat16",
          "passes_per_micro_batch": 4, "inter": 50.0, "intra": 448.0}
    flat, hpz = step_traffic(SHAPE, trainer=tr, hpz=1, **kw), step_traffic(SHAPE, trainer=tr, **kw)
    ring = 2 * SHAPE.params * 63 / 64
    assert flat.micro_batches == hpz.micro_batches == 10
    assert flat.inter_node_bytes == pytest.approx((10 * 4 + 10) * ring) and flat.intra_node_bytes == 0
    assert hpz.inter_node_bytes == pytest.approx((1 + 10) * ring)
    assert hpz.intra_node_bytes == pytest.approx((10 * 4 - 1) * 2 * SHAPE.params * 7 / 8)
    assert flat.seconds == pytest.approx(flat.inter_node_bytes / 50e9) and hpz.seconds < flat.seconds / 2
    one_node = step_traffic(SHAPE, trainer=tr, hpz=1, **{**kw, "world": 8})
    assert one_node.inter_node_bytes == 0 and one_node.intra_node_bytes > 0
    assert step_traffic(SHAPE, trainer=tr, **{**kw, "inter": None}).seconds is None


def test_the_plan_prices_every_stage_and_compares_hpz():
    coll = _plan()["collectives"]
    assert [s["stage"] for s in coll["stages"]] == ["rl-stage-1", "rl-stage-2", "rl-stage-3"]
    assert coll["update_stage"] in ("rl-stage-2", "rl-stage-3")      # the 12K stages move the most
    assert coll["update_bytes_per_rank"] > 1e12 and coll["update_seconds"] > 0
    cmp = coll["hpz_compare"]
    assert cmp["hpz"]["seconds"] < cmp["flat"]["seconds"] and cmp["hpz"]["extra_memory_gb"] > 3
    assert coll["update_bytes_per_rank"] == pytest.approx(cmp["hpz"]["bytes_per_rank"])   # the profile runs hpZ
    assert coll["sft_bytes_per_rank"] > 0 and "upper bound" in coll["assumes"]
