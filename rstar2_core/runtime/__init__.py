"""Where a stage runs: the runtime seam, organised by role.

    async with open_runtime(cfg, policy_url=url, max_model_len=n, trainer=TrainerSpec(...)) as rt:
        ...   # rt.engines, rt.sandbox, rt.grader, rt.trainer, rt.training(), rt.sync_weights()

At this root: the protocol every stage sees (protocol.py: `StageRuntime`, `PolicyTrainer`, the step
body `TrainerStep`), the typed specs `open_runtime` builds from the config once (specs.py), the
factory (factory.py), and what both backends share: building an engine (engine_builder.py), publishing
and reading a trainer's checkpoint (checkpoint.py) and a step's usage accounting (usage.py).
Names are imported on first use. Below it, one package per backend: `local/` (everything in the stage's process) and `ray/` (actors on a
Ray cluster; the only place in rstar2_core that imports Ray). The stages (rl/, sft/, eval/) import this
package; nothing here imports a stage.
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
