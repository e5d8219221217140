"""What the Ray runtime's weight sync assumes of Ray itself, measured: `object_store_roundtrip` pushes one
state dict of a given size from an actor through the object store into another actor, the way
`ObjectStoreSync` does (bench/weight_sync.py `--object-store-probe`; figures in docs/production.md)."""

from __future__ import annotations

import time

import ray


@ray.remote
class _Producer:
    def put(self, n: int) -> list:
        import torch

        state = {"w": torch.arange(n, dtype=torch.float32)}          # like TrainerShardActor.weights_ref
        t = time.perf_counter()
        return [ray.put(state), time.perf_counter() - t]


@ray.remote
class _Consumer:
    def check(self, state: dict) -> bool:                               # like EngineActor.update_weights
        import torch

        w = state["w"]
        n = w.numel()
        return bool(n and torch.equal(w[-3:], torch.arange(n - 3, n, dtype=torch.float32))
                    and float(w.sum(dtype=torch.float64)) == (n - 1) * n / 2)


def object_store_roundtrip(gib: float) -> dict:
    """Start a local Ray with an object store of `gib` + 1 GiB, put a dict holding one float32 tensor of
    `gib` GiB from one actor, receive it as an argument in another and check every element; return the
    seconds (`put_s`, `total_s`) and `ok`, or the `error`. Refuses to run inside a connected driver."""
    if ray.is_initialized():
        raise RuntimeError("object_store_roundtrip starts its own local Ray: this process is already connected")
    n = int(gib * (1 << 30)) // 4
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=int((gib + 1) * (1 << 30)),
             log_to_driver=False)
    try:
        t = time.perf_counter()
        producer = _Producer.remote()                                   # the object's owner: kept alive
        ref, put_s = ray.get(producer.put.remote(n))
        ok = ray.get(_Consumer.remote().check.remote(ref))
        del producer
        return {"gib": gib, "ok": ok, "put_s": put_s, "total_s": time.perf_counter() - t}
    except Exception as e:  # noqa: BLE001 - the outcome is the measurement
        return {"gib": gib, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        ray.shutdown()
