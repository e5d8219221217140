"""`rstar2 plan`: validates the profile, prints the recipe DAG with resources and the 64-GPU actor layout,
matches the flow's task names, and fails fast on a layout that cannot fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rstar2_cli.main import main
from rstar2_core.config import load_config


def _plan_json(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_production_plan(capsys):
    rc, plan = _plan_json(capsys, "--profile", "qwen3-14b-mi300x")
    assert rc == 0
    names = [t["name"] for t in plan["dag"]]
    assert names == ["curate", "sft-data", "base-model", "sft", "eval-sft", "rl-stage-1", "eval-rl-stage-1",
                     "rl-stage-2", "eval-rl-stage-2", "rl-stage-3-hard-subset", "rl-stage-3",
                     "eval-rl-stage-3", "register"]
    dag = {t["name"]: t for t in plan["dag"]}
    assert dag["rl-stage-3"]["deps"] == ["rl-stage-2", "rl-stage-3-hard-subset"]
    assert dag["register"]["deps"] == ["eval-sft", "eval-rl-stage-1", "eval-rl-stage-2", "eval-rl-stage-3"]
    assert (dag["curate"]["num_cpus"], dag["sft"]["num_gpus"], dag["sft"]["num_cpus"]) == (8.0, 0.0, 8.0)
    # the label check samples on the whole-cluster runtime: curate holds the slot like a stage task
    assert dag["rl-stage-1"]["runtime_slot"] and dag["eval-sft"]["runtime_slot"] and dag["curate"]["runtime_slot"]
    assert not dag["sft-data"]["runtime_slot"]
    assert plan["label_check"]["max_generated_tokens"] == 20_000 * 16 * 4096
    lay = plan["layout"]
    assert lay["nodes"] * lay["gpus_per_node"] == 64 and len(lay["engines"]) == 32
    assert len(lay["trainer_shards"]) == 64 and len(lay["placement_groups"]) == 8
    assert plan["image"] == "ghcr.io/rstar2/rstar2-rocm:0.1.0"
    assert plan["problems"] == []     # the stage tasks hold no GPU the layout needs; infra/ matches


def test_plan_labels_match_the_flow_run_names():
    from rstar2_cli.plan import recipe_dag
    from tasks import context
    from tasks.runners import TASK_KINDS

    cfg = load_config("qwen3-14b-mi300x")
    dag = recipe_dag(cfg)
    labels = {t.name: t.label for t in dag}
    for i, st in enumerate(cfg.rl.stages):
        assert labels[st.name] == context.stage_label(cfg, i)
    assert {t.kind for t in dag} <= set(TASK_KINDS)  # the resource keys the pipeline reads


def test_strict_passes_the_production_profile_and_fails_on_an_infra_mismatch(capsys, tmp_path):
    import shutil

    assert main(["plan", "--profile", "qwen3-14b-mi300x", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "64 GPUs" in out and "rl-stage-2 (12K, 10 turns)" in out and "runtime ray: 32 vllm" in out
    assert "infra/ matches the profile" in out and "runtime slot" in out
    # the label check's budget and cost (issue 41: unbounded it sampled the base model for days)
    assert ("label check (curate, holds the runtime slot): <= 20,000 problems x 16 samples x <= 4,096 tokens "
            "(<= 10 turns) = <= 1.31B generated tokens") in out
    # an infra/ whose head lacks the runtime slot: the stage tasks could never be scheduled
    from rstar2_cli.plan import INFRA, infra_problems

    bad = tmp_path / "infra"
    shutil.copytree(INFRA, bad)
    rc = bad / "k8s" / "raycluster.yaml"
    rc.write_text(rc.read_text().replace('resources: \'"{\\"rstar2_runtime\\": 1}"\'', ""))
    problems = infra_problems(load_config("qwen3-14b-mi300x"), bad)
    assert len(problems) == 1 and "rstar2_runtime" in problems[0]


def test_the_pull_step_and_the_production_worker_agree(tmp_path):
    """prefect.yaml's pull step changes into $RSTAR2_REPO: the production flow runs get it from the pool's
    base job template and the image, and it is the image's WORKDIR; an infra/ that sets it nowhere (or
    elsewhere) is refused by `rstar2 plan`."""
    import json
    import shutil

    from rstar2_cli.plan import INFRA, infra_problems

    cfg = load_config("qwen3-14b-mi300x")
    assert "RSTAR2_REPO" in (INFRA.parent / "prefect.yaml").read_text()
    assert infra_problems(cfg) == []
    bad = tmp_path / "infra"
    shutil.copytree(INFRA, bad)
    for f in (bad / "docker").iterdir():
        f.write_text(f.read_text().replace("    RSTAR2_REPO=/opt/rstar2 \\\n", ""))
    tmpl = bad / "prefect" / "base-job-template.json"
    t = json.loads(tmpl.read_text())
    del t["variables"]["properties"]["env"]["default"]["RSTAR2_REPO"]
    tmpl.write_text(json.dumps(t))
    (problem,) = infra_problems(cfg, bad)
    assert "needs $RSTAR2_REPO" in problem and "before the flow starts" in problem
    t["variables"]["properties"]["env"]["default"]["RSTAR2_REPO"] = "/srv/elsewhere"
    tmpl.write_text(json.dumps(t))
    (problem,) = infra_problems(cfg, bad)
    assert "'/srv/elsewhere'" in problem and "WORKDIR '/opt/rstar2'" in problem


def test_layout_that_cannot_fit_exits_2_naming_the_field(capsys):
    rc = main(["plan", "--profile", "qwen3-14b-mi300x", "--set", "rollout.num_engines=40"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "set rollout.num_engines = 32" in err


def test_tiny_plan_has_no_infra_check(capsys):
    rc, plan = _plan_json(capsys, "--profile", "tiny")
    assert rc == 0 and plan["image"] is None and plan["problems"] == []
    assert plan["layout"]["gpus_per_node"] == 0


def test_the_weight_push_is_sized_from_the_policys_config_and_timed_at_the_measured_rates(capsys, tmp_path,
                                                                                          monkeypatch):
    """A local checkpoint's config.json is read; a remote one only with --read-model; the seconds per push
    come from the newest committed bench/weight_sync.py JSON; a live node whose object store is smaller than
    a push is a problem for `object_store`."""
    from rstar2_cli import plan as plan_mod
    from rstar2_core.runtime.layout import NodeResources

    ckpt = tmp_path / "qwen3-14b"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128}))
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-01-01-cpu-weight_sync.json").write_text(json.dumps({"transports": {"object_store": {"gb_per_s": 9.0}}}))
    (results / "2026-02-01-cpu-weight_sync.json").write_text(json.dumps({"transports": {"object_store": {"gb_per_s": 1.0},
                                                                                     "checkpoint": {"gb_per_s": 2.0}}}))
    monkeypatch.setattr(plan_mod, "RESULTS", results)
    monkeypatch.setattr(plan_mod, "INFRA", tmp_path / "infra")
    over = ["--set", 'model.kind="hf"', "--set", f'model.name_or_path="{ckpt}"']
    rc, plan = _plan_json(capsys, "--profile", "tiny", *over)
    push = plan["weight_push"]
    assert rc == 0 and push["bytes"] == 4 * 14_768_307_200 and push["weight_sync"] == "state_dict"
    assert push["rates_from"] == "results/2026-02-01-cpu-weight_sync.json"
    assert push["seconds_at_measured_rate"] == {"object_store": pytest.approx(59.07, abs=0.01),
                                                "checkpoint": pytest.approx(29.54, abs=0.01)}
    assert main(["plan", "--profile", "tiny", *over]) == 0
    assert "59.07 GB per push" in capsys.readouterr().out
    prod = load_config("qwen3-14b-mi300x")
    remote = plan_mod.weight_push(prod, *plan_mod._model_config(prod, False))
    assert remote["bytes"] is None and "--read-model" in remote["source"]
    cfg = load_config("tiny", ['model.kind="hf"', f'model.name_or_path="{ckpt}"', 'cluster.runtime="ray"',
                               'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"',
                               'rollout.weight_sync="object_store"'])
    big = NodeResources("a" * 16, "10.0.0.1", {"object_store_memory": 200e9}, {}, True)
    small = NodeResources("b" * 16, "10.0.0.2", {"object_store_memory": 30e9}, {})
    (problem,) = plan_mod.object_store_problems(plan_mod.weight_push(cfg, *plan_mod._model_config(cfg, False)),
                                                [big, small])
    assert "59.1 GB" in problem and "node bbbbbbbb" in problem and '"checkpoint"' in problem


QWEN3_CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "models" / "Qwen3-14B-Base.config.json")


def test_plan_gives_each_gpus_memory_and_the_collectives_and_refuses_what_does_not_fit(capsys):
    """Given Qwen3-14B's config.json the production plan has per-GPU memory by part and each rank's traffic, and
    fits (--strict exits 0); engines awake at 0.99 of the GPU are a problem naming the setting (exit 1); without a
    config.json the check says it was skipped and why."""
    rc, plan = _plan_json(capsys, "--profile", "qwen3-14b-mi300x", "--model-config", QWEN3_CONFIG, "--strict")
    mem, coll = plan["gpu_memory"], plan["collectives"]
    assert rc == 0 and plan["problems"] == []
    assert mem["device_gb"] == 192 and 0 < mem["rollout_peak_gb"] <= 192 and 0 < mem["update_peak_gb"] <= 192
    assert {k.split(".")[0] for k in mem["parts"]} == {"rollout", "update", "sft"}
    assert coll["update_bytes_per_rank"] > 0 and coll["update_seconds"] > 0
    status = {c["item"]: c["status"] for c in plan["checklist"]}
    assert status == {"layout": "ok", "gpu_memory": "ok", "collectives": "ok", "infra": "ok",
                      "live_cluster": "not checked", "devices": "not checked", "tool_service": "not checked"}
    _, over = _plan_json(capsys, "--profile", "qwen3-14b-mi300x", "--model-config", QWEN3_CONFIG,
                         "--set", "rollout.gpu_memory_utilization=0.99")
    (mem_item,) = [c for c in over["checklist"] if c["item"] == "gpu_memory"]
    assert mem_item["status"] == "problem" and mem_item["problems"] == over["problems"]
    assert main(["plan", "--profile", "qwen3-14b-mi300x", "--model-config", QWEN3_CONFIG, "--strict",
                 "--set", "rollout.gpu_memory_utilization=0.99"]) == 1
    out = capsys.readouterr().out
    assert "GPU memory: the update peak" in out and "rollout.gpu_memory_utilization <=" in out
    assert main(["plan", "--profile", "qwen3-14b-mi300x"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory and collectives: not checked" in out and "--model-config" in out


def test_plan_places_the_tool_service_on_its_own_nodes(capsys):
    """The production profile's sandbox is the tool service: the plan says where and how big it is, puts no
    sandbox CPUs on the GPU nodes, and on a live cluster's nodes refuses a cluster without tool nodes, a GPU
    node declaring the tools' resource, or tool nodes too small for the replicas."""
    from rstar2_cli.plan import tool_service_plan
    from rstar2_core.runtime.layout import NodeResources

    _, plan = _plan_json(capsys, "--profile", "qwen3-14b-mi300x")
    ts = plan["tool_service"]
    assert (ts["backend"], ts["on_gpu_nodes"], ts["node_resource"]) == ("service", False, "rstar2_tools")
    assert (ts["replicas"], ts["max_replicas"], ts["cpus"], ts["concurrent_calls"]) == (16, 32, [240, 480], [480, 960])
    assert plan["layout"]["sandbox_actors"] == []

    cfg = load_config("qwen3-14b-mi300x")

    def node(i, gpus, cpus, tools=0):
        total = {"GPU": gpus, "CPU": cpus, **({"rstar2_tools": tools} if tools else {})}
        return NodeResources(f"{i:016x}", f"10.0.0.{i}", total, dict(total))

    gpu = [node(i, 8, 128) for i in range(8)]
    tools = [node(10 + i, 0, 64, 4) for i in range(8)]
    assert tool_service_plan(cfg, gpu + tools, None)[1] == []
    assert "no live node declares" in tool_service_plan(cfg, gpu, None)[1][0]
    assert any("declare 'rstar2_tools'" in p for p in tool_service_plan(cfg, [node(0, 8, 128, 4)] + tools, None)[1])
    assert "need 240" in tool_service_plan(cfg, gpu + tools[:2], None)[1][0]
    # the actor pool on the GPU nodes is reported as such, with why the item is not checked
    _, pool = _plan_json(capsys, "--profile", "qwen3-14b-mi300x", "--set", 'sandbox.backend="ray"',
                         "--set", "sandbox.service={}")
    (item,) = [c for c in pool["checklist"] if c["item"] == "tool_service"]
    assert pool["tool_service"]["on_gpu_nodes"] and "runs the sandbox on the GPU nodes" in item["why_not_checked"]
