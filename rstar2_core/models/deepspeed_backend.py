"""DeepSpeed ZeRO training backend: the `TrainBackend` protocol (models/backend.py) over `deepspeed.initialize`.

ZeRO stage 0-3, bf16 with fp32 master weights on GPUs (fp32 on CPU), global grad-norm clip, AdamW and
the same schedule as `TorchBackend`, so SFT and RL switch backends with one field (`sft.backend` /
`rl.backend` = "deepspeed", `zero_stage`). One process per rank, with MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE and LOCAL_RANK set (what the tests, torchrun and our Ray trainer shards do).

Invariant: `backward(loss)` once per micro-batch (the caller scales the loss; DeepSpeed does not
divide it), `step()` once per optimizer step: the accumulation boundary of DeepSpeed's
`managed_gradient_accumulation = false` mode. See docs/models-and-sft.md, "Training backends".
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rstar2_core.models.activation_checkpointing import enable_activation_checkpointing
from rstar2_core.models.kernel_check import attention_setup
from rstar2_core.models.schedules import SCHEDULES, lr_factor
from rstar2_core.models.token_logprobs import set_head_kernel

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def deepspeed_config(*, zero_stage: int, grad_clip: float, bf16: bool, micro_batch_size: int = 1,
                     world_size: int = 1, reduce_bucket_size: int = 50_000_000, hpz_partition_size: int = 1) -> dict:
    """The DeepSpeed JSON config for our backend (pure; `deepspeed.initialize(config=...)`).

    `train_micro_batch_size_per_gpu` only feeds DeepSpeed's sample counters: batching and accumulation
    are ours (managed_gradient_accumulation = false). `hpz_partition_size` > 1: ZeRO++ hpZ (ZeRO-3 only; it
    must divide `world_size`)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: DeepSpeed ZeRO stages are 0, 1, 2, 3")
    if hpz_partition_size > 1 and (zero_stage != 3 or world_size % hpz_partition_size):
        raise ValueError(f"zero_hpz_partition_size={hpz_partition_size} needs ZeRO-3 and a world size it divides "
                         f"(zero_stage={zero_stage}, world_size={world_size})")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage in (1, 2):
        zero.update(contiguous_gradients=True, overlap_comm=False, reduce_scatter=True,
                    reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=reduce_bucket_size)
    if zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, overlap_comm=True,
                    reduce_bucket_size=reduce_bucket_size, stage3_prefetch_bucket_size=reduce_bucket_size,
                    stage3_param_persistence_threshold=100_000)
        if hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = hpz_partition_size
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class _ClippingAdamW(torch.optim.AdamW):
    """AdamW that clips the global grad norm itself and records it as `_global_grad_norm`.

    Used only for ZeRO-0 in fp32, where DeepSpeed clips without keeping the norm; the engine runs
    this `step` after its all-reduce, so the norm is the global one."""

    def __init__(self, params, *, grad_clip: float, **kw):
        super().__init__(params, **kw)
        self.grad_clip = grad_clip
        self._global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self._global_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip)) if params else 0.0
        return super().step(closure)


def init_single_process_distributed(dist_backend: str = "gloo") -> None:
    """Join (or create) the default process group from MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
    (one process, or one rank of many: the variables say which)."""
    import deepspeed

    missing = [k for k in _DIST_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"DeepSpeedBackend needs the distributed environment variables {missing}: "
                           "launch with `deepspeed`/torchrun, or for one CPU process set MASTER_ADDR=127.0.0.1 "
                           "MASTER_PORT=<free port> RANK=0 WORLD_SIZE=1 LOCAL_RANK=0")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=dist_backend, auto_mpi_discovery=False)


class DeepSpeedBackend:
    """AdamW + warm-up schedule + clip under a DeepSpeed ZeRO engine. `model` is the engine (an
    nn.Module whose attributes pass through to the wrapped HF model)."""

    def __init__(self, model: nn.Module, *, zero_stage: int = 2, lr: float, total_steps: int,
                 warmup_steps: int = 0, schedule: str = "cosine", weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), grad_clip: float = 1.0, min_lr_ratio: float = 0.0,
                 bf16: bool | None = None, gradient_checkpointing: bool = False, head_kernel: str = "auto",
                 attention_kernel: str = "auto", kernel_check: bool | None = None, dist_backend: str | None = None,
                 micro_batch_size: int = 1, hpz_partition_size: int = 1):
        import deepspeed

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {schedule!r}; valid: {list(SCHEDULES)}")
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        p0 = next(model.parameters())
        on_gpu = p0.device.type == "cuda"
        if bf16 is None:
            bf16 = p0.dtype == torch.bfloat16 or (on_gpu and torch.cuda.is_bf16_supported())
        if bf16 and not on_gpu:
            raise ValueError("DeepSpeedBackend: bf16 needs a GPU; on CPU load the model in float32 "
                             "(model.dtype = \"float32\") or use backend = \"torch\"")
        if bf16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"DeepSpeedBackend: this GPU ({torch.cuda.get_device_name()}) has no bf16 support; set "
                             "model.dtype = \"float32\" (or run on a GPU with bf16: A100/H100/MI200 and newer)")
        set_head_kernel(model, head_kernel, partitioned=zero_stage == 3)
        self.attention_kernel, self.kernel_check_due = attention_setup(model, attention_kernel, kernel_check)
        init_single_process_distributed(dist_backend or ("nccl" if on_gpu else "gloo"))
        if gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.zero_stage, self.bf16 = zero_stage, bool(bf16)
        self.lr, self.total_steps, self.warmup_steps = lr, total_steps, warmup_steps
        self.schedule, self.min_lr_ratio, self.grad_clip = schedule, min_lr_ratio, grad_clip
        self.global_step = 0
        world = torch.distributed.get_world_size()
        self.config = deepspeed_config(zero_stage=zero_stage, grad_clip=grad_clip, bf16=self.bf16,
                                       micro_batch_size=micro_batch_size, world_size=world,
                                       hpz_partition_size=hpz_partition_size)
        params = [p for p in model.parameters() if p.requires_grad]
        if zero_stage == 0 and not self.bf16:
            opt = _ClippingAdamW(params, grad_clip=grad_clip, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
            self.config["gradient_clipping"] = 0.0  # clipped (and measured) inside _ClippingAdamW
        else:
            opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, optimizer=opt, config=self.config,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, self._factor))
        if engine.managed_gradient_accumulation():
            raise RuntimeError(f"deepspeed {deepspeed.__version__} ignores managed_gradient_accumulation = "
                               "false, which this backend needs; install deepspeed>=0.19")
        self.engine, self.model, self.scheduler = engine, engine, scheduler

    def _factor(self, s: int) -> float:
        return lr_factor(s, self.total_steps, self.warmup_steps, self.schedule, self.min_lr_ratio)

    # training --------------------------------------------------------------------------------------
    def autocast(self):
        """No-op: under bf16 DeepSpeed runs the whole module in bf16 (fp32 master weights in the optimizer)."""
        return contextlib.nullcontext()

    @property
    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW underneath DeepSpeed's ZeRO/bf16 wrappers (holds the moments)."""
        opt = self.engine.optimizer
        while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
            opt = opt.optimizer
        return opt

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Boundary: reduce, clip, AdamW step, scheduler step, zero grad; returns the pre-clip grad norm."""
        self.engine.step()
        self.global_step += 1
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError("DeepSpeed did not report a gradient norm for this step")
        return float(norm)

    def reset_optimizer(self) -> None:
        """Fresh AdamW moments (the paper, at stage 3) on every rank's partition; the lr schedule
        position is kept. torch AdamW re-creates empty state lazily at the next step."""
        self.engine.zero_grad()
        self.base_optimizer.state = defaultdict(dict)

    # state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's optimizer (partition) state, scheduler and step."""
        return {"optimizer": self.engine.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.global_step, "zero_stage": self.zero_stage,
                "world_size": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank()}

    def load_state_dict(self, d: dict) -> None:
        missing = {"optimizer", "scheduler", "step"} - set(d)
        if missing:
            raise ValueError(f"backend state is missing {sorted(missing)}; was it saved by DeepSpeedBackend.state_dict()?")
        here = (self.zero_stage, torch.distributed.get_world_size(), torch.distributed.get_rank())
        saved = (d.get("zero_stage", self.zero_stage), d.get("world_size", here[1]), d.get("rank", here[2]))
        if saved != here:
            raise ValueError(f"backend state was saved with (zero_stage, world_size, rank) = {saved}, this process "
                             f"is {here}: resume with the same ZeRO stage and GPU count, or reset_optimizer()")
        opt = self.engine.optimizer
        if "state_dict_list" in inspect.signature(opt.load_state_dict).parameters:  # ZeRO / bf16 wrappers
            parts: list[dict | None] = [None] * here[1]
            parts[here[2]] = d["optimizer"]
            opt.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            opt.load_state_dict(d["optimizer"])
        self.scheduler.load_state_dict(d["scheduler"])
        self.global_step = int(d["step"])

    def save_hf(self, local_dir: str | Path) -> None:
        """HF folder (config + safetensors) on rank 0; every rank must call it under ZeRO-3 (gather)."""
        module = self.engine.module
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective; full dict on rank 0
        else:
            state = None
        if torch.distributed.get_rank() == 0:
            module.save_pretrained(str(local_dir), state_dict=state, safe_serialization=True)
        torch.distributed.barrier()

    def close(self) -> None:
        """Release the engine's hooks and buffers (the process group stays for the next backend)."""
        self.engine.destroy()
