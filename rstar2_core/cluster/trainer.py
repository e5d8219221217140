"""Trainer shards as Ray actors: data-parallel DeepSpeed ranks of the actor model, one per trainer slot
of the layout, driven by one `rl_update` call per RL step.

- `TrainerShardActor(rank, world, model_factory, backend_kwargs)`: a Ray actor; `init(master_addr,
  port)` joins the process group (`DeepSpeedBackend`, gloo on CPU / nccl or rccl on GPUs; Ray has set
  the visible device, so LOCAL_RANK is 0 inside the actor) and builds the engine.
- `TrainerGroup`: spawns the shards in an `ActorGroup` (placement from the layout), initialises them
  together (the rendezvous blocks until every rank has joined), and `rl_update(trajectories, advantages)`
  splits the step's trajectories over the ranks by token count and runs `rl.trainer.rl_update` on each.

Loss scaling across ranks: `rl_update` normalises each rank's loss by that rank's token count, and
DeepSpeed averages gradients over the ranks. Each rank's loss is therefore multiplied by
`world x local_tokens / global_tokens`, which makes the averaged gradient exactly the gradient of the
token-level mean over the whole step (the paper's objective), however unevenly tokens fall on ranks.

Weight sync: `TrainerGroup.weights_ref()` has every rank take part in the gather (ZeRO-3 needs all) and
rank 0 put the full 16-bit state dict in the Ray object store; the returned reference goes straight to
`engines.sync_weights` (no copy through the driver).

    trainers = TrainerGroup(group, layout, model_factory, dict(zero_stage=3, lr=1e-6, total_steps=510))
    metrics = trainers.rl_update(trajectories, advantages, pad_id=tok.pad_token_id)
    sync_weights(engines, trainers.weights_ref(), mode="state_dict")
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rstar2_core.cluster.layout import ClusterLayout
from rstar2_core.cluster.placement import ActorGroup, bundle_strategy


class _ScaledBackend:
    """A TrainBackend view that multiplies every loss by `scale` before backward."""

    def __init__(self, backend: Any, scale: float):
        self._b, self.scale = backend, scale
        self.model = backend.model

    def backward(self, loss):
        self._b.backward(loss * self.scale)

    def __getattr__(self, name: str):
        return getattr(self._b, name)


class TrainerShardActor:
    """One data-parallel rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, model_factory: Callable[[], Any], backend_kwargs: dict):
        self.rank, self.world = rank, world
        self.model_factory, self.backend_kwargs = model_factory, dict(backend_kwargs)
        self.backend = None

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

        from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

        model = self.model_factory()
        if torch.cuda.is_available():
            model = model.to("cuda")
        self.backend = DeepSpeedBackend(model, **self.backend_kwargs)
        return os.getpid()

    def rl_update(self, trajectories: list, advantages: list[float], scale: float, kwargs: dict) -> dict:
        from rstar2_core.rl.trainer import rl_update

        return rl_update(_ScaledBackend(self.backend, scale), trajectories, advantages, **kwargs)

    def weights_ref(self) -> list:
        """[ObjectRef of the full state dict (CPU), bytes] on rank 0, [] elsewhere; collective under ZeRO-3."""
        engine = self.backend.engine
        if self.backend.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = engine.module.state_dict() if self.rank == 0 else None
        if self.rank != 0:
            return []
        state = {k: v.detach().to("cpu") for k, v in state.items()}
        size = sum(v.numel() * v.element_size() for v in state.values())
        return [ray.put(state), size]

    def reset_optimizer(self) -> None:
        self.backend.reset_optimizer()

    def save_hf(self, local_dir: str) -> None:
        self.backend.save_hf(local_dir)

    def pid(self) -> int:
        return os.getpid()


def split_by_tokens(trajectories: Sequence[Any], world: int) -> list[list[int]]:
    """Indices of `trajectories` per rank, longest first onto the least-loaded rank (greedy balancing by
    sampled tokens). Trajectories without a sampled token carry no gradient and are left out; every rank
    gets at least one that has tokens (each rank must take part in the collective step)."""
    useful = [i for i, t in enumerate(trajectories) if sum(t.loss_mask) > 0]
    if len(useful) < world:
        raise ValueError(f"{len(useful)} trajectories with sampled tokens cannot feed {world} trainer ranks; "
                         "lower the trainer count (cluster.trainer_gpus / layout) or raise rl.prompts_per_step")
    order = sorted(useful, key=lambda i: -sum(trajectories[i].loss_mask))
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in order:
        r = min(range(world), key=lambda k: (len(parts[k]) > 0, load[k]))
        parts[r].append(i)
        load[r] += sum(trajectories[i].loss_mask)
    return [sorted(p) for p in parts]


class TrainerGroup:
    """The trainer shards of a layout, in an `ActorGroup` (see the module docstring)."""

    def __init__(self, group: ActorGroup, layout: ClusterLayout, model_factory: Callable[[], Any],
                 backend_kwargs: dict):
        self.group, self.world = group, len(layout.trainer_shards)
        self.names = []
        for s in layout.trainer_shards:
            name = f"trainer-{s.rank}"
            opts = {"num_cpus": 1 if s.bundle_index >= 0 else 0, "num_gpus": s.gpu_fraction,
                    **bundle_strategy(group.pg(s.node), s.bundle_index)}
            group.spawn(name, TrainerShardActor, s.rank, self.world, model_factory, backend_kwargs, **opts)
            self.names.append(name)
        addr, port = group.get(self._actor(0).address.remote(), self.names[0])
        self.pids = group.get([self._actor(r).init.remote(addr, port) for r in range(self.world)], self.names)

    def _actor(self, rank: int):
        return self.group.actors[self.names[rank]]

    def _all(self, method: str, *args: Any) -> list:
        return self.group.get([getattr(self._actor(r), method).remote(*args) for r in range(self.world)], self.names)

    def rl_update(self, trajectories: Sequence[Any], advantages: Sequence[float], **kwargs: Any) -> dict[str, float]:
        """One optimizer step over all ranks; `actor/...` metrics (token-weighted over ranks; grad norm global)."""
        parts = split_by_tokens(trajectories, self.world)
        tokens = [sum(sum(trajectories[i].loss_mask) for i in p) for p in parts]
        total = sum(tokens)
        if total == 0:
            return {"actor/skipped": 1.0, "actor/tokens": 0.0}
        refs = [self._actor(r).rl_update.remote([trajectories[i] for i in p], [float(advantages[i]) for i in p],
                                                self.world * tokens[r] / total, kwargs)
                for r, p in enumerate(parts)]
        results = self.group.get(refs, self.names)
        out = {k: sum(m[k] * t for m, t in zip(results, tokens)) / total
               for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_mean", "actor/ppo_kl",
                         "actor/engine_logprob_gap") if k in results[0]}
        out.update({"actor/grad_norm": results[0]["actor/grad_norm"], "actor/lr": results[0]["actor/lr"],
                    "actor/tokens": float(total), "actor/skipped": 0.0})
        return out

    def weights_ref(self) -> tuple[Any, int]:
        """(ObjectRef of the full state dict, bytes), produced by rank 0 after a collective gather."""
        ref, size = self._all("weights_ref")[0]
        return ref, size

    def reset_optimizer(self) -> None:
        self._all("reset_optimizer")

    def save_hf(self, local_dir: str) -> None:
        """Every rank takes part (ZeRO-3 gather); rank 0 writes `local_dir` on its node."""
        self._all("save_hf", local_dir)
