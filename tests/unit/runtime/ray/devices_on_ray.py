"""Run by test_device_binding.py in a process of its own, because it needs a local Ray with 4 logical GPUs
(the session's shared Ray has none, and its placement tests rely on that): actors on whole and half GPU
bundles of one placement group, as Ray sets them up, with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES in
their runtime_env, and under a CUDA_VISIBLE_DEVICES the worker started with; each reports Ray's id, its
visibility variables and what `resolve_device` binds for a stubbed device count (Ray masks logical GPUs
with CUDA_VISIBLE_DEVICES as it does real ones). Then `rstar2 plan`'s probes on a cuda layout over those
logical GPUs, and whether their placement groups were removed. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))     # tests/, for ray_local
for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
    os.environ.pop(var, None)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray_local import local_ray_session

from rstar2_core.runtime.layout import Bundle, ClusterLayout, PlacementGroupSpec
from rstar2_core.runtime.ray.placement import bundle_strategy

NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
LISTED = {"CUDA_VISIBLE_DEVICES": "5,7,9,11"}


@ray.remote(num_cpus=0)
class Probe:
    def resolve(self, count: int) -> dict:
        from rstar2_core.runtime.devices import DeviceResolutionError, resolve_device
        from rstar2_core.runtime.ray.device_binding import ray_gpu_ids

        ids = ray_gpu_ids()
        env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", *NOSET) if k in os.environ}
        try:
            b = resolve_device(ids, os.environ, count, rocm=False)
        except DeviceResolutionError as e:
            return {"ids": ids, "env": env, "error": str(e)}
        return {"ids": ids, "env": env, "index": b.index, "entry": b.entry}


def main() -> dict:
    out: dict = {}
    pg = placement_group([{"GPU": 1, "CPU": 0.01}] * 4, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    # name: (bundle, GPU share, runtime_env variables, devices torch would see there)
    actors = {"colo-a": (0, 0.5, None, 1), "colo-b": (0, 0.5, None, 1), "masked": (1, 0.5, None, 1),
              "noset": (1, 0.5, NOSET, 4), "listed": (2, 0.5, LISTED, 1), "listed-noset": (2, 0.5, {**LISTED, **NOSET}, 4),
              "whole": (3, 1, None, 1)}
    refs = {}
    for name, (bundle, share, env, count) in actors.items():
        opts = {"num_gpus": share, **bundle_strategy(pg, bundle)}
        if env:
            opts["runtime_env"] = {"env_vars": env}
        refs[name] = Probe.options(**opts).remote().resolve.remote(count)
    out["actors"] = {name: ray.get(ref, timeout=180) for name, ref in refs.items()}
    remove_placement_group(pg)

    from rstar2_core.runtime.ray.device_check import probe_devices

    layout = ClusterLayout("separate", 1, 2, 2, (PlacementGroupSpec("devcheck-node0", 0, (Bundle(1, 1, "gpu"),) * 2),),
                           (), (), (), "cuda")
    out["probe_lines"], out["probe_problems"] = probe_devices(layout, timeout_s=120)
    out["groups_left"] = sorted({v["state"] for v in placement_group_table().values()} - {"REMOVED"})
    return out


if __name__ == "__main__":
    with local_ray_session("devices", num_cpus=2, num_gpus=4):
        print(json.dumps({"devices_on_ray": main()}))
