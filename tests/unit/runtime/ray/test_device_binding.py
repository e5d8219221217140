"""Devices by identity inside the Ray runtime (runtime/ray/device_binding.py, device_check.py): what a
trainer shard and an engine actor bind (torch and Ray stubbed: no GPU here), what an engine reports for its
vLLM workers, when `rstar2 plan --address` skips its device check, and, against a real local Ray with
logical GPUs, that Ray's assigned ids resolve to the right index with and without
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (devices_on_ray.py, in a process of its own). A real GPU
cluster never ran any of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rstar2_core.config import load_config
from rstar2_core.runtime.devices import DeviceReport
from rstar2_core.runtime.engine_builder import EngineSpec
from rstar2_core.runtime.layout import NodeResources, compute_layout
from rstar2_core.runtime.ray import device_binding, device_check
from rstar2_core.runtime.ray.engine_actors import bind_engine

SCRIPT = Path(__file__).with_name("devices_on_ray.py")
NODE = "node 5c3a9e1f (10.0.0.7)"


@pytest.fixture
def on_gpu_5(monkeypatch):
    """An actor Ray gave GPU 5 of node NODE, on a CUDA build of torch."""
    monkeypatch.setattr(device_binding, "ray_gpu_ids", lambda: ["5"])
    monkeypatch.setattr(device_binding, "node_label", lambda: NODE)
    monkeypatch.setattr(device_binding, "_rocm", lambda: False)


def test_a_trainer_shard_with_noset_seeing_all_gpus_binds_the_assigned_one(on_gpu_5, monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert device_binding.bind_trainer_device(env).index == 5 and bound == [5]


def test_a_rocm_trainer_shard_aligns_cuda_with_hip_before_binding(on_gpu_5, monkeypatch):
    """Ray 2.60 masked HIP; the image's CUDA list would trip vLLM's consistency check in this process."""
    monkeypatch.setattr(device_binding, "_rocm", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    env = {"HIP_VISIBLE_DEVICES": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert device_binding.bind_trainer_device(env).index == 0
    assert env["CUDA_VISIBLE_DEVICES"] == "5"


def test_an_engine_narrows_only_on_real_gpus_with_tp_1(on_gpu_5, monkeypatch):
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setattr(os, "environ", env)
    cuda = EngineSpec("vllm", "s3://b/ckpt", 1024, device="cuda")
    for spec in (None, EngineSpec("vllm", "s3://b/ckpt", 1024), cuda.for_actor("cuda", tp_over_ray=True)):
        assert bind_engine(spec) is None and "CUDA_VISIBLE_DEVICES" not in env
    assert bind_engine(cuda).entry == "5" and env["CUDA_VISIBLE_DEVICES"] == "5"


class _VLLMLike:
    def __init__(self, workers):
        self.workers = workers

    def worker_devices(self):
        return self.workers


def _worker(bus: int, ray_gpu: str | None) -> dict:
    return {"uuid": f"GPU-{bus}", "pci_domain_id": 0, "pci_bus_id": bus, "pci_device_id": 0, "name": "H100",
            "ray_gpu": ray_gpu}


def test_engine_reports_name_each_tp_worker_with_the_gpu_vllm_bound_it_to(on_gpu_5):
    tp2 = device_binding.engine_reports("engine-1", _VLLMLike([_worker(0x1B, "2"), _worker(0x1C, "3")]))
    assert tp2 == [DeviceReport("engine-1/tp0", NODE, "2", "GPU-27 pci 0000:1b:00.0"),
                   DeviceReport("engine-1/tp1", NODE, "3", "GPU-28 pci 0000:1c:00.0")]
    # TP 1: the worker is in the engine-core process; the GPU is the actor's own Ray id
    (tp1,) = device_binding.engine_reports("engine-0", _VLLMLike([_worker(0x1B, "0")]))
    assert (tp1.actor, tp1.ray_gpu) == ("engine-0", "5")


def test_a_vllm_worker_reports_the_device_vllm_set_not_the_calling_threads(monkeypatch, on_gpu_5):
    """`WeightSyncExtension.rstar2_device` on a TP worker of rank 1 that vLLM put on cuda:3 (GPU 7 of its
    engine's Ray ids [6, 7]); the RPC thread's current device (0) is not asked."""
    from types import SimpleNamespace

    from rstar2_core.rollout.vllm_engine import WeightSyncExtension

    props = {3: SimpleNamespace(uuid="GPU-3", pci_domain_id=0, pci_bus_id=0x3C, pci_device_id=0, name="H100",
                                total_memory=85_520_809_984)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", props.__getitem__)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    worker = SimpleNamespace(device=torch.device("cuda", 3), local_rank=1, vllm_config=SimpleNamespace(
        parallel_config=SimpleNamespace(assigned_physical_gpu_ids=[6, 7])))
    got = WeightSyncExtension.rstar2_device(worker)
    assert got == {"pci_domain_id": 0, "pci_bus_id": 0x3C, "pci_device_id": 0, "uuid": "GPU-3", "name": "H100",
                   "total_memory": 85_520_809_984, "ray_gpu": "7"}
    (report,) = device_binding.engine_reports("engine-0", _VLLMLike([got]))
    assert report.memory_gib == pytest.approx(79.65, abs=0.01)        # what the memory check compares


def _report(name: str, gpu: str, device: str) -> tuple[str, tuple]:
    return "ok", (DeviceReport(name, NODE, gpu, device), "how")


def test_probe_answers_become_lines_and_problems():
    cfg = load_config("qwen3-14b-mi300x")
    lay = compute_layout(cfg.cluster, cfg.rollout, cfg.sandbox)
    lines, problems = device_check._summarise([_report("node0/gpu0/ray", "0", "d0"), _report("node0/gpu0/noset", "0", "d0"),
                                               _report("node0/gpu1/ray", "1", "d1"), _report("node0/gpu1/noset", "1", "d0")],
                                              lay)
    assert "64 GPU bundle(s)" in lines[0] and "2 problem(s)" in lines[0] and f"{NODE}: 2 distinct" in lines[1]
    assert len(problems) == 2 and all(NODE in p for p in problems)       # d0 shared across GPUs; GPU 1 split
    assert any("node0/gpu1/noset" in p and "node0/gpu0/ray" in p for p in problems)
    lines, problems = device_check._summarise([("error", "node0/gpu3/ray on n: not listed")], lay)
    assert problems == ["node0/gpu3/ray on n: not listed"]


def _nodes(gpus: float, free: float) -> list[NodeResources]:
    return [NodeResources(f"{i:016x}", f"10.0.0.{i}", {"GPU": gpus, "CPU": 128.0}, {"GPU": free, "CPU": 128.0})
            for i in range(8)]


@pytest.mark.parametrize(("profile", "nodes", "why"), [
    ("tiny", [], "computes on the CPU"),
    ("qwen3-14b-mi300x", _nodes(0, 0), "no live node offers GPUs"),
    ("qwen3-14b-mi300x", _nodes(8, 0), "do not fit what is free now"),
])
def test_plan_skips_the_device_check_with_a_line_saying_why(profile, nodes, why):
    """Each of these returns before connecting (no Ray listens at the address given)."""
    from rstar2_cli.plan import build_plan

    cfg = load_config(profile)
    plan = build_plan(cfg, nodes, address="127.0.0.1:1")
    (line,) = [x for x in plan["live_cluster"] if "device check" in x]
    assert "device check skipped" in line and why in line
    (item,) = [c for c in plan["checklist"] if c["item"] == "devices"]
    assert item["status"] == "not checked" and why in item["why_not_checked"]
    assert not any("device check" in x for x in build_plan(cfg, nodes)["live_cluster"])


class _Reports:
    """Stands in for a trainer shard (`device_report`) or an engine actor (`device_reports`)."""

    def __init__(self, reports):
        self.reports = reports

    def device_report(self, name):
        return self.reports[0]

    def device_reports(self, name):
        return self.reports


def test_the_runtime_asks_every_shard_and_engine_and_refuses_a_shared_device(ray_here):
    """Over the session's Ray: two trainer ranks Ray gave GPUs 0 and 1 both on device d0 (what NOSET plus
    binding device 0 did), and a TP-2 engine's workers; the conflict names the node and both ranks."""
    from types import SimpleNamespace

    from rstar2_core.runtime.devices import DeviceConflict
    from rstar2_core.runtime.ray.placement import ActorGroup

    group = ActorGroup()
    try:
        shards = [group.spawn(f"trainer-{r}", _Reports, [DeviceReport(f"trainer-{r}", NODE, str(r), "d0")], num_cpus=0)
                  for r in range(2)]
        engine = group.spawn("engine-0", _Reports, [DeviceReport("engine-0/tp0", NODE, "0", "d0"),
                                                    DeviceReport("engine-0/tp1", NODE, "1", "d1")], num_cpus=0)
        trainer = SimpleNamespace(names=["trainer-0", "trainer-1"], actor=shards.__getitem__)
        engines = [SimpleNamespace(handle=engine, name="engine-0")]
        got = device_check.runtime_device_reports(group, trainer, engines)
        assert [r.actor for r in got] == ["trainer-0", "trainer-1", "engine-0/tp0", "engine-0/tp1"]
        with pytest.raises(DeviceConflict, match=r"node 5c3a9e1f.*trainer-0 \(Ray GPU 0\), trainer-1 \(Ray GPU 1\)"):
            device_check.check_runtime_devices(group, trainer, engines)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_ray_assigned_ids_resolve_under_rays_real_masking_and_with_noset():
    """On a local Ray with 4 logical GPUs (Ray masks them with CUDA_VISIBLE_DEVICES like real ones)."""
    p = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    line = next((x for x in p.stdout.splitlines() if x.startswith('{"devices_on_ray"')), None)
    assert line is not None, p.stderr[-3000:]
    out = json.loads(line)["devices_on_ray"]
    a = out["actors"]
    assert all("error" not in v for v in a.values()), a
    # the colocated pair (0.5 + 0.5 of one bundle) shares one id and, masked by Ray, binds index 0
    assert a["colo-a"]["ids"] == a["colo-b"]["ids"] and a["colo-a"]["index"] == a["colo-b"]["index"] == 0
    # one bundle, masked vs NOSET: one Ray id; NOSET leaves every GPU visible, the index is the id itself
    (gpu,) = a["masked"]["ids"]
    assert a["noset"]["ids"] == [gpu] and "CUDA_VISIBLE_DEVICES" not in a["noset"]["env"]
    assert (a["masked"]["env"]["CUDA_VISIBLE_DEVICES"], a["masked"]["index"], a["noset"]["index"]) == (gpu, 0, int(gpu))
    # a worker that started under CUDA_VISIBLE_DEVICES=5,7,9,11: Ray's ids are values of that list
    (listed,) = a["listed"]["ids"]
    assert listed in {"5", "7", "9", "11"} and a["listed-noset"]["ids"] == [listed]
    assert a["listed"]["index"] == 0 and a["listed-noset"]["env"]["CUDA_VISIBLE_DEVICES"] == "5,7,9,11"
    assert a["listed-noset"]["index"] == ["5", "7", "9", "11"].index(listed)
    assert a["whole"]["index"] == 0
    slots = {a["colo-a"]["ids"][0], gpu, str(["5", "7", "9", "11"].index(listed)), a["whole"]["ids"][0]}
    assert len(slots) == 4                                               # four bundles, four GPUs
    # the plan's probes on logical GPUs: skipped, said so, and nothing left placed
    assert "device check skipped" in out["probe_lines"][0] and "logical" in out["probe_lines"][0]
    assert "cluster.logical_gpus = true" in out["probe_problems"][0]
    assert out["groups_left"] == []


def test_a_gpu_trainer_shard_joins_nccl_in_bf16_on_the_bound_device(on_gpu_5, monkeypatch):
    """After binding, the shard's device is "cuda:5": the process group, ZeRO-3's dtype and the model's place must
    still follow the GPU (they once compared the bound name with "cuda" and would have run gloo in fp32)."""
    from rstar2_core.models import deepspeed_backend
    from rstar2_core.runtime.ray import trainer_shards

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(deepspeed_backend, "init_single_process_distributed", lambda b: seen.update(group=b))
    real = deepspeed_backend.deepspeed_config
    monkeypatch.setattr(deepspeed_backend, "deepspeed_config", lambda **kw: seen.update(bf16=kw["bf16"]) or real(**kw))

    class Placed(Exception):
        pass

    class Model:
        def to(self, device):
            seen["device"] = device
            raise Placed
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):   # init sets them: restored after
        monkeypatch.setenv(k, "")
    shard = trainer_shards.TrainerShardActor(0, 1, Model, {"zero_stage": 3, "grad_clip": 1.0}, None, device="cuda")
    with pytest.raises(Placed):
        shard.init("127.0.0.1", 1)
    assert seen == {"group": "nccl", "bf16": True, "device": "cuda:5"}
