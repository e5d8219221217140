"""GPU probe of the `ipc` weight push (torch only: what the GPU machine has): one process shares a 1.5B-shape
bf16 state dict, another opens it and keeps a copy, packed (production: `pack_bucket`, one buffer and one
CUDA-IPC handle per bucket) against per-tensor handles (the old path); GB/s of each and a bit-exact check.

    python bench/ipc_probe.py [--json] [--shape 1.5b] [--bucket-mib 1024]     (GPU)
    python bench/ipc_probe.py --cpu --shape cpu-small                            (smoke: shared memory, no rate)

The consumer looks the handle up by its own GPU's UUID and opens it on its own device index, as vLLM's
packed consumer does, and copies each tensor out by the bucket's byte table; after the timed pushes two
position-weighted checksums per tensor must equal the producer's. See docs/production.md, "GPU check".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]   # gpu_probes

import torch
import torch.multiprocessing as mp
from gpu_probes import SHAPES, build_model


def state_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the GPU probes' Qwen2 model of `shape` (tied head), built on the meta device."""
    return [(n, tuple(p.shape)) for n, p in build_model(shape, torch.device("meta"), torch.bfloat16).named_parameters()]


def checksums(t: torch.Tensor) -> tuple[int, int]:
    """Two position-weighted sums of the tensor's 16-bit words: a changed, moved or missing element shows."""
    w = t.contiguous().view(-1).view(torch.int16).to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64)
    return int((w * pos).sum()), int((w * (pos % 65521 + 7)).sum())


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"


def _open(handle, device: torch.device) -> torch.Tensor:
    """The tensor behind a CUDA-IPC handle (rebuilt on this process's device index, as vLLM's consumer
    does), or the shared-memory tensor itself on the CPU."""
    if device.type != "cuda":
        return handle
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle)
    args[6] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


def consumer(q_in, q_out, device_name: str) -> None:
    """Open each bucket's buffer (packed) or handles (per tensor), copy the tensors out, ack; on "check",
    answer the checksums of everything it holds (outside the timed pushes)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mine, kept = _uuid(device), {}
    while (msg := q_in.get()) is not None:
        if msg == "check":
            q_out.put({name: checksums(t) for name, t in kept.items()})
            kept = {}
            continue
        kind, table, payload = msg
        if kind == "packed":
            buf, off = _open(payload[mine] if device.type == "cuda" else payload, device), 0
            for name, dtype, shape, size in table:
                kept[name] = buf[off:off + size].view(getattr(torch, dtype)).view(shape).clone()
                off += size
        else:
            for (name, *_), handle in zip(table, payload):
                kept[name] = _open(handle[mine] if device.type == "cuda" else handle, device).clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        q_out.put(len(table))


def _answer(q_out, proc, timeout_s: float = 120.0):
    """The consumer's next answer; raises if it died or said nothing for `timeout_s` (no hang)."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q_out.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"ipc_probe: the consumer process died (exit code {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"ipc_probe: no answer from the consumer in {timeout_s:.0f} s") from None


def push(state: dict, kind: str, bucket_bytes: int, q_in, q_out, proc, device: torch.device) -> float:
    """Seconds of one push of `state` as `kind` ("packed" or "per_tensor"), bucket by bucket, each held
    until the consumer copied it out."""
    from torch.multiprocessing.reductions import reduce_tensor

    from rstar2_core.runtime.ray.weight_sync import buckets, pack_bucket

    names = list(state)
    sizes = [state[n].numel() * state[n].element_size() for n in names]
    uuid = _uuid(device)
    t0 = time.perf_counter()
    for idx in buckets(sizes, bucket_bytes):
        table = [(names[i], str(state[names[i]].dtype).split(".")[-1], list(state[names[i]].shape), sizes[i])
                 for i in idx]
        if kind == "packed":
            buf, _ = pack_bucket(((names[i], state[names[i]]) for i in idx), sum(sizes[i] for i in idx))
            payload = {uuid: reduce_tensor(buf)[1]} if device.type == "cuda" else buf
        else:
            buf = None
            payload = [{uuid: reduce_tensor(state[names[i]])[1]} if device.type == "cuda" else state[names[i]]
                       for i in idx]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        q_in.put((kind, table, payload))
        _answer(q_out, proc)
        del buf, payload
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke test on the CPU (shared memory; no rate)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--shape", default="1.5b", choices=list(SHAPES))
    ap.add_argument("--bucket-mib", type=int, default=1024, help="bytes per bucket (production: IPC_BUCKET_BYTES)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device: run it on a GPU machine, or --cpu for the smoke test")
    device = torch.device("cpu" if a.cpu else "cuda:0")
    torch.manual_seed(0)
    state = {n: torch.randn(s, dtype=torch.bfloat16, device=device) for n, s in state_shapes(a.shape)}
    want = {n: checksums(t) for n, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(q_in, q_out, str(device)), daemon=True)
    proc.start()
    res: dict = {"shape": a.shape, "bytes": nbytes, "tensors": len(state), "bucket_bytes": a.bucket_mib << 20,
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        for kind in ("packed", "per_tensor"):
            secs = []
            for _ in range(a.repeats):
                secs.append(push(state, kind, a.bucket_mib << 20, q_in, q_out, proc, device))
                q_in.put("check")                               # untimed: what the consumer holds
                got = _answer(q_out, proc, 600.0)
                if got != want:
                    bad = [n for n in want if got.get(n) != want[n]]
                    raise RuntimeError(f"ipc_probe: {kind} rebuilt {len(bad)} tensor(s) wrong, first {bad[:3]}")
            best = min(secs)
            res[kind] = {"seconds": best, "seconds_all": secs, "gb_per_s": nbytes / best / 1e9, "exact": True}
        res["packed_vs_per_tensor"] = res["per_tensor"]["seconds"] / res["packed"]["seconds"]
    finally:
        q_in.put(None)
        proc.join(timeout=60)
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
