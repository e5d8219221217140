"""Where stage tasks run: a Ray cluster through prefect-ray's `RayTaskRunner`, or threads in the flow
process.

`cfg.cluster.use_ray` picks Ray; `cfg.cluster.ray_address` names an existing cluster (`auto`,
`ray://head:10001`), unset starts a local Ray for the flow run (no dashboard, temp folder under
/tmp so that Ray's socket paths stay short). Per-task resources come from `cfg.cluster.resources[<kind>]`
(kinds: curate, sft_data, base_model, sft, rl, hard_subset, eval) and reach Ray through prefect-ray's
`remote_options` context; a kind without an entry gets Ray's default (1 CPU).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from rstar2_core.config import Config

TASK_KINDS = ("curate", "sft_data", "base_model", "sft", "rl", "hard_subset", "eval", "register")


def ray_init_kwargs(cfg: Config) -> dict:
    tmp = os.environ.get("RSTAR2_RAY_TMP") or os.path.join(tempfile.gettempdir(), f"rstar2-ray-{os.getuid()}")
    kwargs: dict = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if not cfg.cluster.ray_address:
        kwargs["_temp_dir"] = tmp
        kwargs["num_cpus"] = cfg.cluster.cpus_per_node
        if cfg.cluster.gpus_per_node:
            kwargs["num_gpus"] = cfg.cluster.gpus_per_node
    # Ray workers inherit the state/caches/fault settings of the flow process.
    keep = ("RSTAR2_HOME", "RSTAR2_CONFIG_DIR", "RSTAR2_FAULT_INJECT", "HF_HOME", "HF_HUB_OFFLINE",
            "XDG_CACHE_HOME", "MPLCONFIGDIR", "TOKENIZERS_PARALLELISM", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "RAY_AUTH_MODE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    if cfg.cluster.ray_address:  # a remote cluster does not inherit this process's environment
        kwargs["runtime_env"] = {"env_vars": env}
    return kwargs


def task_runner(cfg: Config):
    """The task runner for the recipe's stage tasks."""
    if not cfg.cluster.use_ray:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=max(2, cfg.cluster.cpus_per_node))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(address=cfg.cluster.ray_address, init_kwargs=ray_init_kwargs(cfg))


def resources(cfg: Config, kind: str) -> dict:
    """Ray remote options of one task kind: {"num_cpus": ..., "num_gpus": ...} (empty = Ray's default)."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; cluster.resources keys are {list(TASK_KINDS)}")
    r = cfg.cluster.resources.get(kind)
    if r is None:
        return {}
    out = {"num_cpus": r.num_cpus}
    if r.num_gpus:
        out["num_gpus"] = r.num_gpus
    return out


@contextlib.contextmanager
def placement(cfg: Config, kind: str) -> Iterator[None]:
    """Submit the tasks inside this block with `kind`'s Ray resources (no-op without Ray)."""
    opts = resources(cfg, kind)
    if not cfg.cluster.use_ray or not opts:
        yield
        return
    from prefect_ray.context import remote_options

    with remote_options(**opts):
        yield
