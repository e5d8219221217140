"""Training backends: one optimizer/scheduler/clip/precision wrapper shared by SFT and RL.

`TrainBackend` is the protocol the trainers code against; `TorchBackend` is plain PyTorch (CPU or one
GPU); `DeepSpeedBackend` (ZeRO, models/deepspeed_backend.py) implements the same protocol.
`make_backend(model, train_cfg, total_steps, warmup_steps, schedule)` picks one from `train_cfg.backend`;
each backend sets `cfg.model.head_kernel` on its model (a `liger` that cannot work is refused before the
first step) and resolves `cfg.model.attention_kernel` (`attention_kernel`, `kernel_check_due`: kernel_check.py).

Invariant: parameters stay in the model's dtype and bf16 autocast runs only on a CUDA device that
supports it (on CPU `autocast()` is a no-op: the resume tests rely on fp32 numerics).
See docs/models-and-sft.md, "Training backends".
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from rstar2_core.models.activation_checkpointing import enable_activation_checkpointing
from rstar2_core.models.kernel_check import attention_setup
from rstar2_core.models.schedules import SCHEDULES, lr_factor
from rstar2_core.models.token_logprobs import set_head_kernel


@runtime_checkable
class TrainBackend(Protocol):
    model: nn.Module
    attention_kernel: str       # "segments" or "flex": `model.attention_kernel` resolved for the device
    kernel_check_due: bool      # the next step compares the kernels first (models/kernel_check.py)

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float:
        """Clip, optimizer step, scheduler step, zero grad; returns the pre-clip global grad norm."""
        ...

    def reset_optimizer(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...

    def save_hf(self, local_dir: str | Path) -> None: ...


def bf16_autocast_supported(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return (p is not None and p.device.type == "cuda" and p.dtype == torch.float32
            and torch.cuda.is_bf16_supported())


class TorchBackend:
    """AdamW + warm-up/cosine-or-constant LambdaLR + global grad-norm clip, on one device."""

    def __init__(self, model: nn.Module, *, lr: float, total_steps: int, warmup_steps: int = 0,
                 schedule: str = "cosine", weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 grad_clip: float = 1.0, min_lr_ratio: float = 0.0, use_autocast: bool | None = None,
                 gradient_checkpointing: bool = False, head_kernel: str = "auto", attention_kernel: str = "auto",
                 kernel_check: bool | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {schedule!r}; valid: {list(SCHEDULES)}")
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        set_head_kernel(model, head_kernel)
        self.attention_kernel, self.kernel_check_due = attention_setup(model, attention_kernel, kernel_check)
        if gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.model = model
        self.lr, self.total_steps, self.warmup_steps = lr, total_steps, warmup_steps
        self.schedule, self.weight_decay, self.betas = schedule, weight_decay, tuple(betas)
        self.grad_clip, self.min_lr_ratio = grad_clip, min_lr_ratio
        self.use_autocast = bf16_autocast_supported(model) if use_autocast is None else use_autocast
        self.global_step = 0
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = bool(params) and params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, betas=self.betas,
                                           weight_decay=self.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, self.warmup_steps, self.schedule,
                                                self.min_lr_ratio))

    # training --------------------------------------------------------------------------------------
    def autocast(self):
        if self.use_autocast:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return float(norm)

    def reset_optimizer(self) -> None:
        """Fresh AdamW moments (the paper, at stage 3); the lr schedule position is kept."""
        self.optimizer.zero_grad(set_to_none=True)
        self._build_optimizer()
        self.scheduler.last_epoch = self.global_step  # keep the schedule position
        for g, f in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            g["lr"] = self.lr * f(self.global_step)

    # state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.global_step}

    def load_state_dict(self, d: dict) -> None:
        missing = {"optimizer", "scheduler", "step"} - set(d)
        if missing:
            raise ValueError(f"backend state is missing {sorted(missing)}; was it saved by TorchBackend.state_dict()?")
        self.optimizer.load_state_dict(d["optimizer"])
        self.scheduler.load_state_dict(d["scheduler"])
        self.global_step = int(d["step"])

    def save_hf(self, local_dir: str | Path) -> None:
        """Write the model as an HF folder (config + safetensors) into `local_dir` (no tokenizer)."""
        self.model.save_pretrained(str(local_dir), safe_serialization=True)


def backend_options(train_cfg: Any, model_cfg: Any, *, total_steps: int, warmup_steps: int,
                    schedule: str) -> dict[str, Any]:
    """The one config -> backend mapping: keyword arguments of `TorchBackend` / `DeepSpeedBackend` for
    `train_cfg` (`cfg.sft` or `cfg.rl`) and `model_cfg` (`cfg.model`). The local runtime, the Ray
    runtime's trainer shards and `make_backend` all build their backend from it."""
    kind = train_cfg.backend
    out: dict[str, Any] = {"lr": train_cfg.lr, "total_steps": max(1, int(total_steps)),
                           "warmup_steps": int(warmup_steps), "schedule": schedule,
                           "weight_decay": train_cfg.weight_decay,
                           "betas": tuple(train_cfg.betas),
                           "grad_clip": train_cfg.grad_clip,
                           "min_lr_ratio": getattr(train_cfg, "min_lr_ratio", 0.0),
                           "gradient_checkpointing": bool(model_cfg.gradient_checkpointing),
                           "head_kernel": model_cfg.head_kernel,
                           "attention_kernel": model_cfg.attention_kernel}
    if kind == "deepspeed":
        out.update(zero_stage=train_cfg.zero_stage, micro_batch_size=train_cfg.micro_batch_size or 1,
                   hpz_partition_size=train_cfg.zero_hpz_partition_size)
    elif kind != "torch":
        raise ValueError(f"unknown training backend {kind!r}; valid: ['torch', 'deepspeed']")
    return out


def make_backend(model: nn.Module, train_cfg: Any, total_steps: int, warmup_steps: int,
                 schedule: str, model_cfg: Any | None = None) -> TrainBackend:
    """Backend for `train_cfg` (`SFTConfig` or `RLConfig`) through `backend_options`; `model_cfg`
    (`cfg.model`, for gradient checkpointing) defaults to off. `deepspeed` is imported lazily."""
    opts = backend_options(train_cfg, model_cfg if model_cfg is not None else _NoModelCfg,
                           total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule)
    if train_cfg.backend == "torch":
        return TorchBackend(model, **opts)
    try:
        from rstar2_core.models.deepspeed_backend import DeepSpeedBackend
    except ImportError as e:
        raise ImportError(f"backend = \"deepspeed\" needs the deepspeed extra and "
                          f"rstar2_core/models/deepspeed_backend.py ({e}); install with "
                          "`pip install -e .[deepspeed]` or set backend = \"torch\"") from e
    return DeepSpeedBackend(model, **opts)


class _NoModelCfg:
    gradient_checkpointing = False
    head_kernel = "auto"
    attention_kernel = "auto"
