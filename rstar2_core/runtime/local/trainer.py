"""The local runtime's trainer: one `TrainBackend` (torch, or DeepSpeed with world size 1) in this process.

It implements `PolicyTrainer` with the step body the stage hands it (`TrainerSpec.step`: rl.trainer.RL_STEP,
sft.step.SFT_STEP), the same one the Ray trainer shards run, and the same checkpoint layout (HF weights
+ `trainer/rank-00000.pt`), so a local and a Ray run of the same config take the same steps.
See docs/runtime.md, "Checkpoints a trainer writes".
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from rstar2_core.models.backend import make_backend
from rstar2_core.models.io import load_model_and_tokenizer, write_hf_folder
from rstar2_core.runtime.checkpoint import read_rank_state, write_rank_state
from rstar2_core.runtime.specs import TrainerSetup


def ensure_single_process_env() -> None:
    """DeepSpeed joins a process group from MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK: set a
    one-process group on a free local port when the launcher did not."""
    if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


class LocalTrainer:
    """`PolicyTrainer` over one backend on `device` (see the module docstring)."""

    world_size = 1

    def __init__(self, setup: TrainerSetup, policy_url: str, device: str):
        spec, optim, dtype = setup.spec, setup.optim, setup.model.dtype
        if dtype != "float32" and device == "cpu" and optim.backend == "deepspeed":
            raise ValueError(f"{spec.section}.backend = \"deepspeed\" trains model.dtype = \"{dtype}\" on GPUs "
                             "only and this process has none: set model.dtype = \"float32\" or run on a GPU node")
        model, _ = load_model_and_tokenizer(policy_url, dtype=dtype, device=device)
        if optim.backend == "deepspeed":
            ensure_single_process_env()
        self.backend = make_backend(model, optim, spec.total_steps, spec.warmup_steps, spec.schedule, setup.model)
        self.spec = spec
        self.busy_s = 0.0

    @property
    def model(self):
        return self.backend.model

    @property
    def current_lr(self) -> float:
        return float(getattr(self.backend, "current_lr", float("nan")))

    def step(self, items: Sequence[Any], *, micro_batch_size: int, **kwargs: Any) -> dict[str, float]:
        step = self.spec.step
        t0 = time.perf_counter()
        try:
            m = step.update(self.backend, items, micro_batch_size=micro_batch_size, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - t0
        return step.merge([m], [sum(step.weight(x) for x in items)])

    def reset_optimizer(self) -> None:
        self.backend.reset_optimizer()

    def load_state(self, checkpoint_url: str) -> bool:
        state = read_rank_state(checkpoint_url, 0, 1)
        if state is None:
            return False
        self.backend.load_state_dict(state)
        return True

    def save(self, staging_url: str, optimizer: bool = True) -> None:
        write_hf_folder(self.backend.save_hf, staging_url)
        if optimizer:
            write_rank_state(staging_url, 0, 1, self.backend.state_dict())

    def weights(self) -> dict[str, Any]:
        """The current weights as a state dict of this process's tensors (for the in-process sync)."""
        engine = getattr(self.backend, "engine", None)       # DeepSpeed: the HF module is engine.module
        if engine is None:
            return {k: v.detach() for k, v in self.backend.model.state_dict().items()}
        if getattr(self.backend, "zero_stage", 0) == 3:
            return dict(engine._zero3_consolidated_16bit_state_dict())
        return {k: v.detach() for k, v in engine.module.state_dict().items()}

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()
