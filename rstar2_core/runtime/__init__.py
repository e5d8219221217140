"""Where a stage runs: the runtime seam, organised by role.

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec(...)) as rt:
        ...   # rt.engines, rt.sandbox, rt.grader, rt.trainer, rt.training(), rt.sync_weights()

At this root: the protocol (protocol.py), the specs `open_runtime` builds from the config once (specs.py),
the factory, and what both backends share (engine_builder.py, checkpoint.py, usage.py, layout.py,
sandboxes.py). Below it one package per backend: `local/` and `ray/` (the only place that imports Ray).
Invariant: nothing here imports a stage (rl/, sft/, eval/); names are imported on first use.
See docs/runtime.md, "The runtime seam".
"""

from __future__ import annotations

from rstar2_core.lazy_exports import lazy_exports

# names load on first use: the trainers' step bodies import runtime.protocol on a GPU node where only
# torch and transformers are installed (bench/gpu_check.py), so this package must not import the config
_EXPORTS = {
    "RUNTIMES": "specs", "RuntimeSpec": "specs", "TrainerSetup": "specs",
    "open_runtime": "factory", "runtime_for": "factory",
    "PolicyTrainer": "protocol", "RuntimeUsage": "protocol", "StageRuntime": "protocol", "TrainerSpec": "protocol",
    "TrainerStep": "protocol", "WeightSyncReport": "protocol",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["RUNTIMES", "PolicyTrainer", "RuntimeSpec", "RuntimeUsage", "StageRuntime", "TrainerSetup",
           "TrainerSpec", "TrainerStep", "WeightSyncReport", "open_runtime", "runtime_for"]
