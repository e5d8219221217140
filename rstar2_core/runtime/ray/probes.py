"""What the Ray runtime's weight sync assumes of Ray itself, measured: `object_store_roundtrip` pushes one
state dict of a given size from an actor through the object store into another actor, the way
`ObjectStoreSync` does. `python -m rstar2_core.runtime.ray.probes GIB` prints its JSON (bench/weight_sync.py
`--object-store-probe`; figures in docs/benchmarks-training.md)."""

from __future__ import annotations

import time

import ray


def _checksum(t) -> int:
    """Exact and order-free: the tensor's 32-bit words summed as integers."""
    import torch

    return int(t.contiguous().view(-1).view(torch.int32).sum(dtype=torch.int64))


@ray.remote
class _Producer:
    def put(self, n: int) -> list:
        import torch

        state = {"w": torch.randn(n, generator=torch.Generator().manual_seed(0))}   # like weights_ref's
        t = time.perf_counter()
        ref = ray.put(state)
        return [ref, time.perf_counter() - t, _checksum(state["w"])]


@ray.remote
class _Consumer:
    def check(self, state: dict) -> list:                               # like EngineActor.update_weights
        return [_checksum(state["w"]), state["w"].numel()]


def object_store_roundtrip(gib: float) -> dict:
    """Start a local Ray with an object store of `gib` + 1 GiB, put a dict holding one float32 tensor of
    `gib` GiB from one actor, receive it as an argument in another and compare an exact checksum of every
    word and the element count; return the seconds (`put_s`, `total_s`) and `ok`, or the `error`. Refuses
    to run inside a connected driver."""
    if ray.is_initialized():
        raise RuntimeError("object_store_roundtrip starts its own local Ray: this process is already connected")
    n = int(gib * (1 << 30)) // 4
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=int((gib + 1) * (1 << 30)),
             log_to_driver=False)
    try:
        t = time.perf_counter()
        producer = _Producer.remote()                                   # the object's owner: kept alive
        ref, put_s, want = ray.get(producer.put.remote(n))
        got, numel = ray.get(_Consumer.remote().check.remote(ref))
        ok = got == want and numel == n
        del producer
        return {"gib": gib, "ok": ok, "put_s": put_s, "total_s": time.perf_counter() - t}
    except Exception as e:  # noqa: BLE001 - the outcome is the measurement
        return {"gib": gib, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(object_store_roundtrip(float(sys.argv[1]))))
