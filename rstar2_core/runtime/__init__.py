"""The runtime seam every stage runs through (protocol.py) and what both implementations share: the one
engine builder (engines.py), token-balanced sharding with equal micro-batch counts (sharding.py),
per-rank trainer state in checkpoints (trainer_state.py, checkpoint.py), the step's usage accounting
(usage.py), and the local implementation (local.py, local_trainer.py).

The stages open a runtime with `rstar2_core.cluster.open_runtime(cfg, ...)`, which picks `LocalRuntime`
or the Ray one (rstar2_core/cluster/runtime.py) by `cluster.runtime`; this package needs no Ray.
"""

from __future__ import annotations

from rstar2_core.runtime.protocol import (
    PolicyTrainer,
    RuntimeUsage,
    StageRuntime,
    TrainerSpec,
    TrainerStep,
    WeightSyncReport,
)

__all__ = ["PolicyTrainer", "RuntimeUsage", "StageRuntime", "TrainerSpec", "TrainerStep", "WeightSyncReport"]
