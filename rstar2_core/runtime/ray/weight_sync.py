"""Trainer -> engine weight sync on the Ray runtime, one interface with a backend per `rollout.weight_sync`.

    sync = make_weight_sync(mode, runtime)      # built once per runtime
    report = sync.push(checkpoint_url)         # after every optimizer step; bytes and seconds

Backends: `object_store` (`ObjectStoreSync`), `checkpoint` (`CheckpointSync`), `nccl` (`NCCLSync`, vLLM,
separate layout), `ipc` (`IPCSync`, vLLM, colocated); sleep mode around the step is `_Sync.training`.
Invariant: a push returns only once every engine serves the new weights, and an engine failing its side
of a transfer fails the sync instead of leaving a trainer rank in the collective. `nccl` and `ipc` have
not run on GPUs. See docs/ray-runtime.md, "Weight sync".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rstar2_core.runtime.protocol import WeightSyncReport

IPC_BUCKET_BYTES = 1 << 30
"""Bytes of parameters gathered and shared per IPC round (1 GiB: ~30 rounds for 14B in bf16)."""


def make_weight_sync(mode: str, rt: Any):
    cls = {"object_store": ObjectStoreSync, "checkpoint": CheckpointSync, "nccl": NCCLSync, "ipc": IPCSync}.get(mode)
    if cls is None:
        raise ValueError(f"rollout.weight_sync = {mode!r} is not a Ray-runtime backend; valid: "
                         "['object_store', 'checkpoint', 'nccl', 'ipc']")
    return cls(rt)


class _Sync:
    def __init__(self, rt: Any):
        self.rt = rt
        self.asleep = False    # the engines are in vLLM's sleep mode (see `training`)

    @property
    def engines(self):
        return self.rt.engines

    @property
    def trainer(self):
        return self.rt.trainer

    def _wait_engines(self, refs: list) -> tuple[float, ...]:
        return tuple(float(e.get(r) or 0.0) for e, r in zip(self.engines, refs))

    def _both_sides(self, trainer_refs: list, engine_refs: list) -> list:
        """The engines' results of one NCCL step whose trainer-rank calls are `trainer_refs`. Both sides
        are waited on in one `group.get` (the engines are actors of the same group): `ray.get` of a list
        raises as soon as one result is an error, without waiting for the rest, so the first failure on
        either side raises at once. Waiting on one side first would block for good when the other side
        failed: its peers sit in the rendezvous or the broadcast and never return. Any failure shuts the
        group down before it propagates (a death as `ActorFailure`, like every `group.get`): the survivors
        cannot leave the collective."""
        tr = self.trainer
        try:
            out = tr.group.get(list(trainer_refs) + list(engine_refs), tr.names + [e.name for e in self.engines])
        except BaseException:
            tr.group.shutdown()
            raise
        return out[len(trainer_refs):]

    def _call_engines(self, method: str, *args: Any) -> None:
        self._wait_engines([e.handle.call.remote(method, *args) for e in self.engines])

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around the optimizer step and its push: with `rollout.release_memory_during_training` the
        engines sleep on entry; the push wakes them, or, without one, a normal exit does (module docstring)."""
        if self.rt.spec.release_memory_during_training and not self.asleep:
            self._call_engines("sleep", 1)
            self.asleep = True
        yield
        if self.asleep:
            self._call_engines("wake_up", None)
            self.asleep = False

    def push(self, checkpoint_url: str | None = None) -> WeightSyncReport:
        t0 = time.perf_counter()
        asleep = self.asleep
        if asleep:
            self._call_engines("wake_up", ["weights"])
        size, secs = self._transfer(checkpoint_url)
        if asleep:
            self._call_engines("wake_up", ["kv_cache"])
            self.asleep = False
        return WeightSyncReport(self.mode, size, time.perf_counter() - t0, secs)


class ObjectStoreSync(_Sync):
    mode = "object_store"

    def _transfer(self, checkpoint_url):
        ref, size = self.trainer.weights_ref()
        return size, self._wait_engines([e.handle.update_weights.remote(ref) for e in self.engines])


class CheckpointSync(_Sync):
    mode = "checkpoint"

    def _transfer(self, checkpoint_url):
        if not checkpoint_url:
            raise ValueError("rollout.weight_sync = \"checkpoint\" needs the URL of the checkpoint the step published")
        return 0, self._wait_engines([e.handle.update_weights.remote(checkpoint_url) for e in self.engines])


# ------------------------------------------------------------------------------------------- vLLM: nccl
def _named_full_parameters(shard: Any, names: set[str] | None = None):
    """(name, full tensor) of the parameters of a rank's model (all, or those in `names`), in order.
    Under ZeRO-3 each is gathered for the duration of its yield (a collective: every rank must walk the
    same sequence)."""
    module = shard.backend.engine.module
    for name, p in module.named_parameters():
        if names is not None and name not in names:
            continue
        if shard.backend.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, p.data
        else:
            yield name, p.data


def _param_meta(shard: Any) -> tuple[list[str], list[str], list[list[int]], list[int]]:
    """Names, dtypes, full shapes and bytes of every parameter, without gathering (ZeRO-3 keeps the full
    shape as `ds_shape`): safe to ask of one rank."""
    names, dtypes, shapes, sizes = [], [], [], []
    for name, p in shard.backend.engine.module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        names.append(name)
        dtypes.append(str(p.dtype).split(".")[-1])
        shapes.append(shape)
        sizes.append(_numel(shape) * p.element_size())
    return names, dtypes, shapes, sizes


def buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices in buckets of at most `bucket_bytes` (a bigger tensor is alone)."""
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not out or (size + n > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _shard_source(shard: Any):
    """vLLM's `WeightSource` over a trainer rank's model: metadata from `_param_meta` (no gather), a pass
    walks `_named_full_parameters` (ZeRO-3: one gather per parameter, on every rank)."""
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class ShardSource(WeightSource):
        def metadata(self):
            names, dtypes, shapes, _ = _param_meta(shard)
            return [ParamMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]

        def __iter__(self):
            return iter(_named_full_parameters(shard))

    return ShardSource()


class DriverDrivenClient:
    """The `VLLMWeightSyncClient` handed to vLLM's trainer engine on each rank. vLLM's trainer engine calls
    its client (init, start, update, finish) from inside trainer rank 0, beside the collective; here the
    driver makes those calls on the engine actors itself (`NCCLSync`), concurrently with the ranks, so that
    it waits on both sides of the collective at once and sees an engine that fails in its side (rank 0
    cannot: it sits in the broadcast for good, as vLLM's `send_weights` notes). The client records what
    vLLM's trainer engine would have told the engines, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(("init", dict(init_info)))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, update_info) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish",))


def _nccl_trainer_init(shard: Any, master_address: str, master_port: int, world_size: int) -> None:
    """Every rank: vLLM's NCCL trainer engine (rank 0 opens the group as its rank 0; the others only take
    part in the gathers of each pass)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size,
                               rank=shard.rank)
    shard.extras["nccl"] = WeightTransferTrainerFactory.trainer_init(info, client=DriverDrivenClient(),
                                                                     source=_shard_source(shard))


def _nccl_send(shard: Any) -> None:
    shard.extras["nccl"].send_weights()


def nccl_engine_init_info(master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict:
    """What engine workers get at `init_weight_transfer`: the rendezvous, their rank offset, and the packed
    wire settings of `NCCLTrainerInitInfo` (its defaults: the trainer side is built with them), which
    vLLM's update info no longer carries."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    t = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size, rank=0)
    return worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
        packed=t.packed, packed_buffer_size_bytes=t.packed_buffer_size_bytes, packed_num_buffers=t.packed_num_buffers))


def nccl_group(tps: list[int]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the weight-transfer group: trainer rank 0 is rank 0,
    engine i's TP workers take the next `tps[i]` ranks."""
    offsets, k = [], 1
    for tp in tps:
        offsets.append(k)
        k += tp
    return k, offsets


class NCCLSync(_Sync):
    mode = "nccl"

    def __init__(self, rt: Any):
        super().__init__(rt)
        self.meta: tuple | None = None

    def _setup(self) -> None:
        tr = self.trainer
        addr, port = tr.group.get(tr.actor(0).address.remote(), tr.names[0])
        world, offsets = nccl_group([e.tp for e in self.engines])
        eng = [e.handle.call.remote("init_weight_transfer", nccl_engine_init_info(addr, port, off, world))
               for e, off in zip(self.engines, offsets)]
        trn = [tr.actor(r).call.remote(_nccl_trainer_init, addr, port, world) for r in range(tr.world)]
        self._both_sides(trn, eng)        # both sides block in the rendezvous: issued and waited on together
        self.meta = tr.group.get(tr.actor(0).call.remote(_param_meta), tr.names[0])

    def _transfer(self, checkpoint_url):
        if self.meta is None:
            self._setup()
        names, dtypes, shapes, sizes = self.meta
        tr = self.trainer
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        eng = [e.handle.call.remote("receive_weights", info) for e in self.engines]
        secs = self._both_sides([tr.actor(r).call.remote(_nccl_send) for r in range(tr.world)], eng)
        return sum(sizes), tuple(float(s or 0.0) for s in secs)


# -------------------------------------------------------------------------------------------- vLLM: ipc
def pack_bucket(named: Iterator[tuple[str, Any]], total_bytes: int) -> tuple[Any, list[int]]:
    """One uint8 buffer (on the tensors' device) holding the tensors `named` yields, back to back (vLLM's
    packed IPC layout: its `unpack_tensor` splits it by the byte sizes returned beside it). Each tensor is
    copied in while it is alive (under ZeRO-3 a gathered parameter lives only for its yield), so the
    memory is the bucket's."""
    import torch

    buf, sizes, off = None, [], 0
    for _, t in named:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        n = flat.numel()
        if buf is None:
            buf = torch.empty(total_bytes, dtype=torch.uint8, device=flat.device)
        if off + n > total_bytes:
            raise ValueError(f"pack_bucket: the tensors exceed the bucket's {total_bytes} bytes")
        buf[off:off + n].copy_(flat)
        sizes.append(n)
        off += n
    if buf is None or off != total_bytes:
        raise ValueError(f"pack_bucket: {off} bytes packed, the bucket's table says {total_bytes}")
    return buf, sizes


def _ipc_bucket(shard: Any, names: list[str], total_bytes: int) -> dict:
    """Gather the parameters `names` into one packed buffer on this rank's GPU, keep it alive in
    `shard.extras` until `_ipc_release`, and return its one CUDA-IPC handle keyed by this GPU's UUID (the
    engine worker that opens it looks its own GPU's UUID up, whatever index its visibility list gives that
    GPU) and the byte size of each parameter in it."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    buf, sizes = pack_bucket(_named_full_parameters(shard, set(names)), total_bytes)
    shard.extras["ipc_held"] = buf
    return {"handle": {uuid: reduce_tensor(buf)[1]}, "tensor_sizes": sizes}


def _ipc_release(shard: Any) -> None:
    shard.extras.pop("ipc_held", None)


IPC_INIT_INFO = {"packed": True}
"""What engine workers get at `init_weight_transfer` for IPC: packed (one buffer and handle per bucket)."""


def ipc_update_info(names: list[str], dtypes: list[str], shapes: list[list[int]], parts: list[dict]) -> dict:
    """vLLM's packed IPC update info for one bucket from the colocated ranks' `_ipc_bucket` results: one
    handle per GPU (`{uuid: rebuild args}`), the bucket's table (names, dtype names, shapes, byte sizes)."""
    sizes = parts[0]["tensor_sizes"]
    if any(p["tensor_sizes"] != sizes for p in parts):
        raise ValueError("ipc: the colocated ranks packed the bucket differently")
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "tensor_sizes": sizes,
            "ipc_handles": {k: v for p in parts for k, v in p["handle"].items()}}


class IPCSync(_Sync):
    """Per push: every engine opens an update (`start_weight_update`); each bucket of parameters
    (`IPC_BUCKET_BYTES`) is gathered on every rank into one packed buffer, shared as one CUDA-IPC handle
    per GPU and loaded by the engines (`receive_weight_chunk`, vLLM's packed IPC update info: its workers
    clone the tensors out, so the buffer is freed before the next bucket); then the engines close the
    update (`finish_weight_update`). A rank holds one bucket at a time. The trainer side is ours (vLLM's
    IPC trainer engine gathers the handles over the default process group, which here holds the trainer
    ranks only, and assumes one client it drives from rank 0); what crosses is vLLM's wire format."""

    mode = "ipc"

    def __init__(self, rt: Any):
        super().__init__(rt)
        self.meta: tuple | None = None

    def colocated_ranks(self) -> list[list[int]]:
        """Per engine, the trainer ranks sharing its GPUs (its TP workers' bundles on its node)."""
        lay = self.rt.layout
        by_bundle = {(s.node, s.bundle_index): s.rank for s in lay.trainer_shards}
        out = []
        for slot in lay.engines:
            ranks = [by_bundle[(slot.node, b)] for b in slot.bundle_indices if (slot.node, b) in by_bundle]
            if len(ranks) != len(slot.bundle_indices):
                raise ValueError(f"engine {slot.index} has GPUs without a colocated trainer rank: rollout.weight_sync "
                                 "= \"ipc\" needs cluster.layout = \"colocated\"")
            out.append(ranks)
        return out

    def _transfer(self, checkpoint_url):
        tr = self.trainer
        ranks = self.colocated_ranks()
        if self.meta is None:
            self._call_engines("init_weight_transfer", IPC_INIT_INFO)
            self.meta = tr.group.get(tr.actor(0).call.remote(_param_meta), tr.names[0])
        names, dtypes, shapes, sizes = self.meta
        self._call_engines("start_weight_update")
        try:
            for idx in buckets(sizes, IPC_BUCKET_BYTES):
                bn, total = [names[i] for i in idx], sum(sizes[i] for i in idx)
                parts = tr.group.get([tr.actor(r).call.remote(_ipc_bucket, bn, total) for r in range(tr.world)],
                                     tr.names)
                bd, bs = [dtypes[i] for i in idx], [shapes[i] for i in idx]
                self._wait_engines([e.handle.call.remote("receive_weight_chunk",
                                                         ipc_update_info(bn, bd, bs, [parts[r] for r in rs]))
                                    for e, rs in zip(self.engines, ranks)])
                tr.group.get([tr.actor(r).call.remote(_ipc_release) for r in range(tr.world)], tr.names)
        except BaseException:
            tr.group.shutdown()      # an engine left mid-update: the runtime is torn down, as for NCCL
            raise
        self._call_engines("finish_weight_update")
        return sum(sizes), ()


def _numel(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
