"""Trainer shards as Ray actors: the data-parallel DeepSpeed ranks of the policy, one per trainer slot
of the layout, behind the `PolicyTrainer` protocol (runtime/protocol.py).

`TrainerShardActor` joins the process group in `init` (gloo on CPU, nccl/rccl on GPUs) and builds its
`DeepSpeedBackend` (under ZeRO-3 inside `deepspeed.zero.Init`); `TrainerGroup` spawns, places and
initialises the shards together and runs each optimizer step on all of them with the stage's step body.
Invariant: every rank runs the same number of micro-batches over its token-balanced share (sharding.py),
and the step's gradient is exactly the whole batch's token mean. See docs/ray-runtime.md, "Trainer shards".

    metrics = trainers.step(list(zip(trajectories, advantages)), micro_batch_size=8, pad_id=pad_id, ...)
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rstar2_core import storage
from rstar2_core.runtime.layout import TRAINER_SHARD_CPUS, ClusterLayout, TrainerShard
from rstar2_core.runtime.protocol import TrainerStep
from rstar2_core.runtime.ray.placement import ActorGroup, bundle_strategy
from rstar2_core.runtime.ray.sharding import micro_batches_per_rank, rank_balance, split_by_weight


def own_storage(state: dict) -> dict:
    """`state`'s tensors on the CPU, each in a storage of its own. Pickling a tensor (what `ray.put` does)
    writes its whole storage: ZeRO-1/2 keep the parameters as views of one flat buffer, so a state dict of
    views put as is carried the buffer once per tensor (SmolLM2's 651 MB became > 16 GB and the rank was
    OOM-killed). A GPU tensor's `.to("cpu")` is already a copy of its own; a CPU one is cloned."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


class TrainerShardActor:
    """One data-parallel rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, model_factory: Callable[[], Any], backend_options: dict,
                 step: TrainerStep, threads: int = 0, device: str = "cpu", storage_s3: dict | None = None):
        if storage_s3:
            storage.configure_s3(**storage_s3)   # the driver's S3 endpoint: this rank reads and writes its shards
        self.rank, self.world, self.device = rank, world, device
        self.model_factory, self.backend_options = model_factory, dict(backend_options)
        self.step_body, self.threads = step, threads
        self.backend = None
        self.binding = None       # the device bound in `init` on real GPUs (runtime/devices.DeviceBinding)
        self.busy_s = 0.0

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port) for the rendezvous; asked of rank 0."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, master_addr: str, master_port: int) -> int:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        import torch

        from rstar2_core.models.deepspeed_backend import DeepSpeedBackend, deepspeed_config
        from rstar2_core.runtime.ray.engine_actors import set_torch_threads

        set_torch_threads(self.threads)
        device = self.device
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"trainer rank {self.rank} was placed on a GPU bundle but sees no GPU "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); on a cluster "
                               "whose GPUs are logical Ray resources set cluster.logical_gpus = true")
        if device == "cuda":      # the GPU Ray assigned, by position in what this process sees (device_binding.py)
            from rstar2_core.runtime.ray.device_binding import bind_trainer_device

            self.binding = bind_trainer_device()
            os.environ["LOCAL_RANK"] = str(self.binding.index)    # what DeepSpeed binds
            device = f"cuda:{self.binding.index}"
        if self.backend_options.get("zero_stage") == 3:
            from transformers.integrations import HfDeepSpeedConfig

            from rstar2_core.models.deepspeed_backend import init_single_process_distributed

            on_gpu = self.device == "cuda"     # `device` is the bound "cuda:N" there
            init_single_process_distributed("nccl" if on_gpu else "gloo")   # zero.Init needs the group
            ds = deepspeed_config(zero_stage=3, grad_clip=self.backend_options["grad_clip"], bf16=on_gpu,
                                  micro_batch_size=self.backend_options.get("micro_batch_size", 1),
                                  world_size=self.world,
                                  hpz_partition_size=self.backend_options.get("hpz_partition_size", 1))
            self._hf_ds = HfDeepSpeedConfig(ds)   # kept alive: from_pretrained then builds under zero.Init
        model = self.model_factory()
        model = model.to(device)
        self.backend = DeepSpeedBackend(model, **self.backend_options)
        return os.getpid()

    def device_report(self, name: str):
        """This rank's device by identity (runtime/ray/device_check.py); only on real GPUs."""
        from rstar2_core.runtime.ray.device_binding import local_report

        return local_report(name, self.binding.index)

    def update(self, items: list, kwargs: dict) -> dict:
        """This rank's share of one optimizer step (the stage's `TrainerStep.update`)."""
        t0 = time.perf_counter()
        try:
            return self.step_body.update(self.backend, items, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0

    def weights_ref(self) -> list:
        """[ObjectRef of the full state dict (CPU), bytes] on rank 0, [] elsewhere; collective under ZeRO-3."""
        engine = self.backend.engine
        if self.backend.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict() if self.rank == 0 else None
        if self.rank != 0:
            return []
        state = own_storage(state)
        size = sum(v.numel() * v.element_size() for v in state.values())
        return [ray.put(state), size]

    def reset_optimizer(self) -> None:
        self.backend.reset_optimizer()

    def save(self, staging_url: str, optimizer: bool = True) -> None:
        from rstar2_core import storage
        from rstar2_core.runtime.checkpoint import write_rank_state

        with storage.staging_dir() as d:
            self.backend.save_hf(d)                  # collective under ZeRO-3; rank 0 writes
            if self.rank == 0:
                storage.upload_dir(d, staging_url)
        if optimizer:
            write_rank_state(staging_url, self.rank, self.world, self.backend.state_dict())

    def load_state(self, checkpoint_url: str) -> bool:
        from rstar2_core.runtime.checkpoint import read_rank_state

        state = read_rank_state(checkpoint_url, self.rank, self.world)
        if state is None:
            return False
        self.backend.load_state_dict(state)
        return True

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(self, *args)` on this rank (the weight-transfer steps of rstar2_core/runtime/ray/weight_sync.py, which
        keep their per-rank state in `self.extras`)."""
        if not hasattr(self, "extras"):
            self.extras: dict[str, Any] = {}
        return fn(self, *args)

    def busy_seconds(self) -> float:
        return self.busy_s

    def pid(self) -> int:
        return os.getpid()


def trainer_shard_options(shard: TrainerShard, pg: Any | None) -> dict[str, Any]:
    """Ray actor options for one trainer shard of the layout (its GPU share of its bundle)."""
    return {"num_cpus": TRAINER_SHARD_CPUS if shard.bundle_index >= 0 else 0, "num_gpus": shard.gpu_fraction,
            **bundle_strategy(pg, shard.bundle_index)}


class TrainerGroup:
    """The trainer shards of a layout, in an `ActorGroup`; a `PolicyTrainer` (see the module docstring)."""

    def __init__(self, group: ActorGroup, layout: ClusterLayout, model_factory: Callable[[], Any],
                 backend_options: dict, step: TrainerStep, threads: int = 0, ready_timeout_s: float | None = None):
        self.group, self.world, self.step_body = group, len(layout.trainer_shards), step
        self.names = []
        for s in layout.trainer_shards:
            name = f"trainer-{s.rank}"
            group.spawn(name, TrainerShardActor, s.rank, self.world, model_factory, backend_options, step,
                        threads, layout.device, storage.s3_settings(), **trainer_shard_options(s, group.pg(s.node)))
            self.names.append(name)
        group.wait_ready(self.names, ready_timeout_s, "trainer shards")   # all placed before the rendezvous
        addr, port = group.get(self.actor(0).address.remote(), self.names[0])
        self.pids = group.get([self.actor(r).init.remote(addr, port) for r in range(self.world)], self.names)

    world_size = property(lambda self: self.world)

    @property
    def busy(self) -> list[float]:
        """Each rank's cumulative seconds in its step bodies."""
        return self.all("busy_seconds")

    def actor(self, rank: int):
        return self.group.actors[self.names[rank]]

    def all(self, method: str, *args: Any) -> list:
        return self.group.get([getattr(self.actor(r), method).remote(*args) for r in range(self.world)], self.names)

    def step(self, items: Sequence[Any], *, micro_batch_size: int, split: list[list[int]] | None = None,
             **kwargs: Any) -> dict[str, float]:
        """One optimizer step over all ranks (see the module docstring); `split` forces which item indices
        go to which rank (tests)."""
        body = self.step_body
        parts = split if split is not None else split_by_weight(items, self.world, body.weight, body.length)
        tokens = [sum(body.weight(items[i]) for i in p) for p in parts]
        total = sum(tokens)
        if total == 0:
            return body.merge([], [])
        need = micro_batches_per_rank(
            parts, lambda p: len(body.cut([items[i] for i in p], micro_batch_size=micro_batch_size, **kwargs)))
        kw = {**kwargs, "micro_batch_size": micro_batch_size, "total_tokens": total,
              "num_micro_batches": need, "loss_scale": float(self.world)}
        results = self.group.get([self.actor(r).update.remote([items[i] for i in p], kw)
                                  for r, p in enumerate(parts)], self.names)
        merged = body.merge(results, tokens)
        balance = rank_balance(parts, [body.length(x) for x in items])
        if balance != float("inf"):          # a rank with no work: nothing to compare (and MLflow takes no inf)
            merged["trainer/rank_balance"] = balance
        return merged

    def weights_ref(self) -> tuple[Any, int]:
        """(ObjectRef of the full state dict, bytes), produced by rank 0 after a collective gather."""
        ref, size = self.all("weights_ref")[0]
        return ref, size

    def reset_optimizer(self) -> None:
        self.all("reset_optimizer")

    def save(self, staging_url: str, optimizer: bool = True) -> None:
        self.all("save", staging_url, optimizer)

    def load_state(self, checkpoint_url: str) -> bool:
        found = self.all("load_state", checkpoint_url)
        if any(found) and not all(found):
            raise ValueError(f"{checkpoint_url}: trainer state found for some ranks only ({found})")
        return all(found)

    def close(self) -> None:
        """The shards stop with their ActorGroup (RayRuntime.aclose)."""
