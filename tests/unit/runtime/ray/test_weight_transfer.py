"""vLLM weight transfer on the Ray runtime (runtime/ray/weight_sync.py), driven end to end in one process: the
real `NCCLSync` / `IPCSync` drivers, the real per-rank steps (`_nccl_trainer_init`, `_nccl_send`,
`_ipc_bucket`, `_ipc_release`, `_param_meta`) run through the real `TrainerShardActor.call`, vLLM's own
trainer factory and `NCCLTrainerWeightTransferEngine`, and the real `EngineActor` + `VLLMEngine` over the
stand-in engine of tests/vllm_fake.py (it parses what it gets with vLLM's info classes and refuses what
vLLM 0.32 refuses: an update outside start/finish, unknown keys). Faked: the processes (calls run in
place), the NCCL trainer engine's two GPU calls (its endpoint and packed broadcast: `NCCLWire` records
them), CUDA (each rank's GPU UUID, `reduce_tensor` handles) and ZeRO-3's gather. What is checked: what each
engine is told per push or per bucket, the rank offsets of the NCCL group, which ranks' handles (by GPU
UUID) reach which engine, what rank 0 sends, that every rank takes part in each gather, and that the IPC
buckets are released. The in-place fakes run a call when it is issued, which hides the order in which the
driver waits on the two sides of a collective: the failure test runs each actor's calls on its own thread
instead (`_ThreadedActor`, Ray's get/wait/kill faked over it) with the real ActorGroup and RemoteEngine, and
checks that an engine raising or dying in its side of the NCCL sync fails the sync instead of hanging it.
Not checked: real NCCL/CUDA IPC or a vLLM engine on a GPU (none here)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm_fake import (
    FakeAsyncLLM,
    InProcessEngine,
    NCCLWire,
    fake_checkpoint,
    install_fake_vllm,
)

from rstar2_core.config import load_config

_RANK = {"current": 0}     # the rank whose step is running: its "GPU" for the faked CUDA calls


def _model() -> nn.Module:
    torch.manual_seed(3)
    m = nn.Module()
    m.lin = nn.Linear(4, 3)                                   # float32: 48 + 12 bytes
    m.emb = nn.Embedding(5, 2).to(torch.bfloat16)             # bfloat16: 20 bytes
    return m


class _Shard:
    """Ray's view of a TrainerShardActor, in process: `.<method>.remote(...)` runs the real method."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, method):
        def run(*args):
            if method == "address":
                return ("10.0.0.1", 29500)
            _RANK["current"] = self.actor.rank
            return getattr(self.actor, method)(*args)
        return SimpleNamespace(remote=run)


class _Trainer:
    """TrainerGroup's surface that the syncs use (`group.get`, `actor(r)`, `names`, `world`)."""

    def __init__(self, world: int, zero_stage: int = 2):
        from rstar2_core.runtime.ray.trainer_shards import TrainerShardActor

        self.world, self.names, self.group = world, [f"trainer-{r}" for r in range(world)], self
        self.shards = []
        for r in range(world):
            a = TrainerShardActor(r, world, None, {}, None)
            a.backend = SimpleNamespace(engine=SimpleNamespace(module=_model()), zero_stage=zero_stage)
            self.shards.append(a)

    def get(self, refs, names):
        return refs

    def actor(self, r):
        return _Shard(self.shards[r])


def _engines(n: int, tp: int, transfer: str, tmp_path):
    from rstar2_core.rollout.vllm_engine import VLLMEngine
    from rstar2_core.runtime.ray.engine_actors import EngineActor

    ckpt = fake_checkpoint(tmp_path)
    actors = [EngineActor(None, factory=lambda: VLLMEngine(ckpt, tensor_parallel_size=tp, weight_transfer=transfer))
              for _ in range(n)]
    return [InProcessEngine(a, f"engine-{i}", tp) for i, a in enumerate(actors)]


def _close(engines):
    for e in engines:
        asyncio.run(e._actor.close())


def _updates(fake) -> list[dict]:
    return [ev[1] for ev in fake.events if isinstance(ev, tuple) and ev[0] == "update"]


META = (["lin.weight", "lin.bias", "emb.weight"], ["float32", "float32", "bfloat16"], [[3, 4], [3], [5, 2]],
        [48, 12, 20])


# ------------------------------------------------------------------------------------------------ nccl
def _kinds(fake) -> list:
    return [ev if isinstance(ev, str) else ev[0] for ev in fake.events]


def test_nccl_joins_one_group_at_rank_offsets_and_rank_0_sends_every_parameter(monkeypatch, tmp_path):
    install_fake_vllm(monkeypatch)
    from rstar2_core.runtime.ray.weight_sync import NCCLSync, _param_meta

    trainer, engines = _Trainer(2), _engines(3, 2, "nccl", tmp_path)
    assert _param_meta(trainer.shards[0]) == META
    sync = NCCLSync(SimpleNamespace(engines=engines, trainer=trainer))
    update = {"names": META[0], "dtype_names": META[1], "shapes": META[2]}     # no wire settings per update
    for push in range(2):
        rep = sync.push()
        assert rep.mode == "nccl" and rep.bytes == 80 and len(rep.engine_seconds) == 3
        # set up once: every rank builds vLLM's trainer engine, rank 0 opens a 7-rank group as its rank 0
        assert NCCLWire.inits == [{"master_address": "10.0.0.1", "master_port": 29500, "world_size": 7,
                                   "packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2,
                                   "rank": 0}]
        assert [type(s.extras["nccl"]).__name__ for s in trainer.shards] == ["NCCLTrainerWeightTransferEngine"] * 2
        assert [s.extras["nccl"].is_sender for s in trainer.shards] == [True, False]
        for i, fake in enumerate(FakeAsyncLLM.instances):
            # engine i's 2 TP workers from rank 1 + 2i, with the trainer's packed wire settings
            inits = [ev[1] for ev in fake.events if isinstance(ev, tuple) and ev[0] == "init"]
            assert inits == [{"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1 + 2 * i,
                              "world_size": 7, "packed": True, "packed_buffer_size_bytes": 1 << 30,
                              "packed_num_buffers": 2}]
            assert _updates(fake) == [update] * (push + 1)
            # each push: generation paused, one update opened and closed, the prefix cache reset
            assert _kinds(fake) == ["init"] + ["pause", "start", "update", "finish", "reset", "resume"] * (push + 1)
        # what vLLM's trainer engine asked its client is what the driver told the engines (but for the offset)
        calls = trainer.shards[0].extras["nccl"].client.calls
        assert calls[0][0] == "init" and calls[0][1]["rank_offset"] == 1 and calls[1:] == [
            ("start",), ("update", update), ("finish",)] * (push + 1)
        # one packed broadcast per push, from rank 0 only, every parameter in order
        assert len(NCCLWire.sent) == push + 1
        sent, wire = NCCLWire.sent[-1]
        assert wire == {"src": 0, "buffer_size_bytes": 1 << 30, "num_buffers": 2}
        module = trainer.shards[0].backend.engine.module
        assert [n for n, _ in sent] == META[0]
        for (n, t), (_, p) in zip(sent, module.named_parameters()):
            assert torch.equal(t, p.detach())
    _close(engines)


def test_zero3_every_rank_gathers_each_parameter_and_meta_uses_the_full_shapes(monkeypatch, tmp_path):
    """Under ZeRO-3 a rank holds a partition (`p.data` empty, `ds_shape` the full shape): the meta comes
    from `ds_shape` without gathering, and each send walks the parameters one `GatheredParameters` at a
    time on every rank (a collective), rank 0 sending what was gathered."""
    import deepspeed

    install_fake_vllm(monkeypatch)
    from rstar2_core.runtime.ray.weight_sync import NCCLSync, _param_meta

    trainer = _Trainer(2, zero_stage=3)
    full = {r: {n: p.data.clone() for n, p in s.backend.engine.module.named_parameters()}
            for r, s in enumerate(trainer.shards)}
    for s in trainer.shards:                       # partitioned: nothing local, the full shape kept aside
        for p in s.backend.engine.module.parameters():
            p.ds_shape = tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype)
    gathers: list[tuple[int, str]] = []

    @contextlib.contextmanager
    def gathered(params, modifier_rank=None):
        (p,) = params
        rank = _RANK["current"]
        name = next(n for n, q in trainer.shards[rank].backend.engine.module.named_parameters() if q is p)
        gathers.append((rank, name))
        p.data = full[rank][name].clone()
        yield
        p.data = torch.empty(0, dtype=p.dtype)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathered)
    assert _param_meta(trainer.shards[0]) == META and gathers == []
    engines = _engines(3, 2, "nccl", tmp_path)
    NCCLSync(SimpleNamespace(engines=engines, trainer=trainer)).push()
    assert sorted(gathers) == sorted((r, n) for r in range(2) for n in META[0])
    (sent, _), = NCCLWire.sent
    assert [n for n, _ in sent] == META[0]
    for n, t in sent:
        assert torch.equal(t, full[0][n])
    _close(engines)


# ------------------------------------------------------------------------------------------------- ipc
def test_ipc_buckets_carry_the_colocated_ranks_handles_by_gpu_uuid_and_are_released(monkeypatch, tmp_path):
    """Each bucket crosses as vLLM's packed IPC update: one buffer and one handle per GPU, keyed by the GPU's
    UUID, with the bucket's table; the real vLLM classes accept the update and unpack the buffer bit-exact."""
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    install_fake_vllm(monkeypatch)
    from torch.multiprocessing import reductions

    from rstar2_core.runtime.ray import weight_sync
    from rstar2_core.runtime.specs import layout_for

    shared: list[tuple] = []     # what each handle points at: (GPU uuid, packed buffer)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _RANK["current"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    monkeypatch.setattr(reductions, "reduce_tensor",
                        lambda t: shared.append((f"GPU-{_RANK['current']}", t)) or ("handle", len(shared) - 1))
    monkeypatch.setattr(weight_sync, "IPC_BUCKET_BYTES", 60)           # lin.weight + lin.bias | emb.weight
    cfg = load_config("qwen3-14b-mi300x", ["cluster.nodes=1", "rollout.num_engines=4"])
    layout = layout_for(cfg)
    trainer, engines = _Trainer(8), _engines(4, 2, "ipc", tmp_path)
    sync = weight_sync.IPCSync(SimpleNamespace(engines=engines, trainer=trainer, layout=layout))
    rep = sync.push()
    assert rep.mode == "ipc" and rep.bytes == 80
    buckets = [(["lin.weight", "lin.bias"], ["float32", "float32"], [[3, 4], [3]], [48, 12]),
               (["emb.weight"], ["bfloat16"], [[5, 2]], [20])]
    module = trainer.shards[0].backend.engine.module
    params = dict(module.named_parameters())
    for i, fake in enumerate(FakeAsyncLLM.instances):         # engine i's TP workers sit on GPUs 2i, 2i+1
        ups = _updates(fake)
        assert [(u["names"], u["dtype_names"], u["shapes"], u["tensor_sizes"]) for u in ups] == buckets
        for u in ups:
            IPCWeightTransferUpdateInfo(**u)                  # vLLM's own class takes it as it is
            assert set(u["ipc_handles"]) == {f"GPU-{2 * i}", f"GPU-{2 * i + 1}"}
            for uuid, k in u["ipc_handles"].items():          # one buffer per GPU, {uuid: rebuild args}
                gpu, buf = shared[k]
                assert gpu == uuid and buf.dtype == torch.uint8 and buf.numel() == sum(u["tensor_sizes"])
                got = unpack_tensor(buf, u["names"], u["shapes"], [getattr(torch, d) for d in u["dtype_names"]],
                                    u["tensor_sizes"])
                for name, t in got:
                    assert torch.equal(t, params[name].detach()), name
        # one update per push, a chunk per bucket, with generation paused and the prefix cache reset after
        assert fake.events[0] == ("init", {"packed": True}) and IPCWeightTransferInitInfo(**fake.events[0][1]).packed
        assert _kinds(fake) == ["init", "pause", "start", "update", "update", "finish", "reset", "resume"]
    assert len(shared) == 8 * 2                   # every rank shares one buffer per bucket
    assert all("ipc_held" not in s.extras for s in trainer.shards)   # released after each bucket
    _close(engines)


def test_pack_bucket_refuses_a_table_that_does_not_match():
    from rstar2_core.runtime.ray.weight_sync import pack_bucket

    named = [("a", torch.ones(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))]
    buf, sizes = pack_bucket(iter(named), 16)
    assert sizes == [12, 4] and buf.numel() == 16
    with pytest.raises(ValueError, match="exceed"):
        pack_bucket(iter(named), 12)
    with pytest.raises(ValueError, match="table says 20"):
        pack_bucket(iter(named), 20)


def test_ipc_holds_each_bucket_until_the_engines_loaded_it(monkeypatch, tmp_path):
    """The shared copies must outlive the engines' load (a freed tensor's handle points at reused memory)."""
    install_fake_vllm(monkeypatch)
    from torch.multiprocessing import reductions

    from rstar2_core.runtime.ray import weight_sync
    from rstar2_core.runtime.specs import layout_for

    monkeypatch.setattr(torch.cuda, "current_device", lambda: _RANK["current"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: ("handle", id(t)))
    cfg = load_config("qwen3-14b-mi300x", ["cluster.nodes=1", "rollout.num_engines=4"])
    trainer, engines = _Trainer(8), _engines(4, 2, "ipc", tmp_path)
    held_at_load: list[int] = []
    update = FakeAsyncLLM.update_weights

    async def recording(self, request):
        held_at_load.append(sum(1 for s in trainer.shards if "ipc_held" in s.extras))
        await update(self, request)

    monkeypatch.setattr(FakeAsyncLLM, "update_weights", recording)
    weight_sync.IPCSync(SimpleNamespace(engines=engines, trainer=trainer, layout=layout_for(cfg))).push()
    assert held_at_load == [8] * 4              # one bucket (1 GiB default): its buffer held on each of 8 ranks
    assert all("ipc_held" not in s.extras for s in trainer.shards)
    _close(engines)


# ------------------------------------------------------------------- nccl: a failing engine, concurrently
class _ThreadedActor:
    """A Ray actor handle over `obj`, with the concurrency the in-place fakes above hide: `.<method>.remote()`
    queues the call on the actor's own thread (Ray runs an actor's calls one at a time, beside the driver)
    and returns a `Future` as its ref, read by the driver only through `ray.get` / `ray.wait` (faked by
    `_fake_ray`). `kill()` (`ray.kill`) marks it dead: the call it is running then (a process killed in the
    rendezvous) and every later one raise `ActorDiedError`; another error of a call raises as Ray's
    `RayTaskError(<cause>)`."""

    def __init__(self, obj):
        self.obj, self.dead = obj, False
        self.pool = ThreadPoolExecutor(1)

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *args: self.pool.submit(self._run, method, args))

    def _run(self, method, args):
        import ray.exceptions as rex

        if self.dead:
            raise rex.ActorDiedError()
        try:
            return True if method == "__ray_ready__" else getattr(self.obj, method)(*args)
        except BaseException as e:
            if self.dead:
                raise rex.ActorDiedError() from e
            raise rex.RayTaskError(method, traceback.format_exc(), e).as_instanceof_cause() from e

    def kill(self):
        self.dead = True


def _fake_ray(monkeypatch, on_kill):
    """`ray.get` / `ray.wait` / `ray.kill` over `_ThreadedActor` refs, as the real ActorGroup and RemoteEngine
    call them. `get` of a list raises the first error as soon as it is there, without waiting for the rest
    (what Ray does: test_placement.py's blocked-rank test, for a death); `on_kill()` runs at every kill (a
    killed process leaves the rendezvous, which breaks it for its peers)."""
    import ray
    import ray.exceptions as rex

    def get(refs, timeout=None):
        many = isinstance(refs, list)
        done, pending = futures.wait(refs if many else [refs], timeout, futures.FIRST_EXCEPTION)
        failed = [f for f in (refs if many else [refs]) if f in done and f.exception() is not None]
        if failed:
            raise failed[0].exception()
        if pending:
            raise rex.GetTimeoutError("timed out")
        return [f.result() for f in refs] if many else refs.result()

    def wait(refs, num_returns=1, timeout=None):
        futures.wait(refs, timeout, futures.FIRST_COMPLETED)
        ready = [f for f in refs if f.done()][:num_returns]
        return ready, [f for f in refs if f not in ready]

    def kill(handle, no_restart=True):
        handle.kill()
        on_kill()

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "kill", kill)


def _joining(collective: threading.Barrier, real):
    async def joined(request):
        collective.wait()
        await real(request)
    return joined


@pytest.mark.parametrize("how", ["raises", "dies"])
@pytest.mark.parametrize("step", ["init_weight_transfer", "receive_weights"])
def test_an_engine_failing_its_side_of_the_nccl_sync_fails_the_sync_instead_of_hanging_it(monkeypatch, tmp_path, step,
                                                                                         how):
    """Trainer rank 0 and every engine meet in vLLM's NCCL rendezvous (setup) and broadcast (each push): a
    party that never arrives leaves the others blocked for good. When engine 1 raises, or dies, in its
    side, the sync raises that failure (a death as ActorFailure naming the engine) after the group was shut
    down, instead of waiting on the trainer ranks, which sit in the collective until they are killed.
    Real: NCCLSync, ActorGroup, RemoteEngine, TrainerShardActor, EngineActor + VLLMEngine over the fake
    vllm; faked: Ray's processes (`_ThreadedActor`), the collective (a barrier of rank 0 and the engines)."""
    install_fake_vllm(monkeypatch)
    from rstar2_core.rollout.vllm_engine import VLLMEngine
    from rstar2_core.runtime.ray.engine_actors import EngineActor, RemoteEngine
    from rstar2_core.runtime.ray.errors import ActorFailure
    from rstar2_core.runtime.ray.placement import ActorGroup
    from rstar2_core.runtime.ray.trainer_shards import TrainerShardActor
    from rstar2_core.runtime.ray.weight_sync import NCCLSync

    collective = threading.Barrier(1 + 3)      # trainer rank 0 + 3 engines (one party each here)
    _fake_ray(monkeypatch, collective.abort)
    open_endpoint, broadcast = NCCLWire.open_endpoint, NCCLWire.broadcast

    def joined_open(init_info):                 # rank 0's side of the collective joins it
        collective.wait()
        return open_endpoint(init_info)

    def joined_broadcast(**kw):
        collective.wait()
        return broadcast(**kw)

    monkeypatch.setattr(NCCLWire, "open_endpoint", joined_open)
    monkeypatch.setattr(NCCLWire, "broadcast", joined_broadcast)

    class Rank(TrainerShardActor):
        def address(self):
            return ("10.0.0.1", 29500)

    group = ActorGroup(None)
    world = 2
    for r in range(world):
        rank = Rank(r, world, None, {}, None)
        rank.backend = SimpleNamespace(engine=SimpleNamespace(module=_model()), zero_stage=2)
        group.actors[f"trainer-{r}"] = _ThreadedActor(rank)
    engines = []
    ckpt = fake_checkpoint(tmp_path)
    for i in range(3):
        name = f"engine-{i}"
        group.actors[name] = _ThreadedActor(EngineActor(None, factory=lambda: VLLMEngine(
            ckpt, tensor_parallel_size=1, weight_transfer="nccl")))
        engines.append(RemoteEngine(group.actors[name], name, 1, on_failure=group.failure))
    actors = dict(group.actors)
    fakes = FakeAsyncLLM.instances
    for fake in fakes:                          # every engine's side of the collective joins it ...
        for method in ("init_weight_transfer_engine", "update_weights"):
            setattr(fake, method, _joining(collective, getattr(fake, method)))
    vllm_method = {"init_weight_transfer": "init_weight_transfer_engine", "receive_weights": "update_weights"}[step]

    async def fails(request):                   # ... but engine 1's, which raises or dies instead
        if how == "dies":
            actors["engine-1"].kill()
        raise RuntimeError(f"engine 1: NCCL error in {step}")

    setattr(fakes[1], vllm_method, fails)
    trainer = SimpleNamespace(group=group, names=["trainer-0", "trainer-1"], world=world,
                              actor=lambda r: group.actors[f"trainer-{r}"])
    sync = NCCLSync(SimpleNamespace(engines=engines, trainer=trainer))
    seen: dict = {}

    def push():
        try:
            sync.push()
        except BaseException as e:              # noqa: BLE001 - handed to the test's thread
            seen.update(error=e, actors_left=dict(group.actors))

    t = threading.Thread(target=push, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), f"the sync still waits 30 s after engine 1 failed in {step}"
    finally:
        collective.abort()                      # a regression leaves rank 0 in the collective: let it out
        t.join(10)
        for a in actors.values():
            a.pool.shutdown(wait=True, cancel_futures=True)
        for a in actors.values():
            if isinstance(a.obj, EngineActor):
                asyncio.run(a.obj.close())
    err = seen["error"]
    assert seen["actors_left"] == {}, "the group was not shut down before the failure was raised"
    assert all(a.dead for a in actors.values())
    if how == "dies":
        assert isinstance(err, ActorFailure) and err.actor == "engine-1"
    else:
        assert isinstance(err, RuntimeError) and f"engine 1: NCCL error in {step}" in str(err)


def test_an_ipc_handle_reaches_the_engine_worker_whatever_index_its_visibility_list_gives_the_gpu(monkeypatch):
    """The trainer rank sees its GPU as index 0 of ["GPU-3"] (CUDA/HIP_VISIBLE_DEVICES=3); a TP-2 engine worker
    sees ["GPU-5", "GPU-3"] and sits on index 1. vLLM's real packed consumer finds the handle by the UUID the
    rank keyed it with and opens it at the worker's own index; a worker on another GPU is refused by name."""
    from vllm.distributed.weight_transfer import packed_tensor

    from rstar2_core.runtime.ray import weight_sync

    visible = {"trainer": ["GPU-3"], "worker": ["GPU-5", "GPU-3"]}
    side = {"now": "trainer"}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=visible[side["now"]][i]))
    from torch.multiprocessing import reductions

    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (None, ("args", 0, 0, 0, 0, 0, "trainer-index", t)))
    shard = SimpleNamespace(backend=SimpleNamespace(engine=SimpleNamespace(module=_model()), zero_stage=2), extras={})
    names, dtypes, shapes, sizes = META
    part = weight_sync._ipc_bucket(shard, names, sum(sizes))
    info = weight_sync.ipc_update_info(names, dtypes, shapes, [part])
    assert list(info["ipc_handles"]) == ["GPU-3"]
    opened = []

    def rebuild(self, list_args):              # CUDA IPC itself cannot run here: the buffer the handle names
        opened.append(list_args[6])
        return list_args[7]

    monkeypatch.setattr(packed_tensor.PackedBufferImporter, "rebuild", rebuild)
    side["now"] = "worker"
    got = packed_tensor.packed_ipc_consumer(info["ipc_handles"], names, shapes, dtypes, info["tensor_sizes"], 1)
    params = dict(shard.backend.engine.module.named_parameters())
    assert opened == [1] and [n for n, _ in got] == names
    assert all(torch.equal(t, params[n].detach()) for n, t in got)
    with pytest.raises(ValueError, match="IPC handle not found for GPU UUID GPU-5"):
        packed_tensor.packed_ipc_consumer(info["ipc_handles"], names, shapes, dtypes, info["tensor_sizes"], 0)
