"""Connecting to (or starting) Ray for the pipeline and the Ray runtime, with the same settings everywhere.

`ray_init_kwargs(cluster)`: `ray.init` arguments for the `cluster` section (a local Ray sized by
`cluster.cpus_per_node`/`gpus_per_node`, or `cluster.ray_address`) and the environment the workers
inherit; `ensure_ray(cluster)` initialises Ray in this process unless it already is. Invariant: every
pipeline task that drives a Ray runtime asks for the one `RUNTIME_RESOURCE` unit ("rstar2_runtime", on
the head), so they run one at a time; Ray is imported inside the functions only.
See docs/runtime.md, "One runtime at a time".
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from rstar2_core.config.pipeline_sections import ClusterConfig

RUNTIME_RESOURCE = "rstar2_runtime"
WORKER_NICENESS = 0
"""Niceness of the workers of a Ray this process starts (added to its own). Ray's default is 15, which
puts the workers, where the stages compute (SFT, the trainer shards, the engines), below every service
of a one-machine run (the Prefect server, the MLflow UI, the flow process, Ray's own GCS and raylet). It
is not what makes the demo's SFT step ~1.2x slower than alone (measured: docs/demo.md, "What each mode runs").
A Ray cluster started with `ray start` keeps its own setting (`ray start --system-config`)."""
INHERITED_ENV = ("RSTAR2_HOME", "RSTAR2_CONFIG_DIR", "RSTAR2_FAULT_INJECT", "HF_HOME", "HF_HUB_OFFLINE",
                 "XDG_CACHE_HOME", "MPLCONFIGDIR", "TOKENIZERS_PARALLELISM", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "RAY_AUTH_MODE")


def ray_init_kwargs(cluster: ClusterConfig) -> dict:
    tmp = os.environ.get("RSTAR2_RAY_TMP") or os.path.join(tempfile.gettempdir(), f"rstar2-ray-{os.getuid()}")
    kwargs: dict = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if not cluster.ray_address:
        kwargs["_temp_dir"] = tmp
        kwargs["num_cpus"] = cluster.cpus_per_node
        kwargs["resources"] = {RUNTIME_RESOURCE: 1}
        kwargs["_system_config"] = {"worker_niceness": WORKER_NICENESS}
        if cluster.gpus_per_node:
            kwargs["num_gpus"] = cluster.gpus_per_node
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    if cluster.ray_address:  # a remote cluster does not inherit this process's environment
        kwargs["runtime_env"] = {"env_vars": env}
    return kwargs


def ensure_ray(cluster: ClusterConfig) -> None:
    """`ray.init` for the `cluster` section unless this process is already connected."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        ray.init(address=cluster.ray_address or None, **ray_init_kwargs(cluster))


def disconnect_ray() -> None:
    """End this process's Ray connection (and the local Ray it started), if any: the workers' forwarded
    logs are flushed before it returns."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def driver_connection(address: str) -> Iterator[None]:
    """A short driver connection of this process (which must not be connected to another Ray) to the Ray
    cluster at `address` (`host:port` of its GCS), ended on leaving: run it where a driver can run, e.g. on
    the head, with the cluster's Ray version."""
    if address.startswith("ray://"):
        raise ValueError(f"--address {address}: give the GCS address (host:6379) and run where a Ray driver can "
                         "connect (e.g. on the head); a Ray Client (ray://) connection is not used")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def probe_cluster(address: str) -> list:
    """The live nodes (`layout.NodeResources`, head first) of the Ray cluster at `address`, read through a
    `driver_connection`."""
    with driver_connection(address):
        from rstar2_core.runtime.ray.placement import live_nodes

        return live_nodes()


def holds_runtime_slot() -> bool:
    """True in a Ray task or actor that was assigned the cluster's single `RUNTIME_RESOURCE`: the one
    process that may have a runtime's placement groups on the cluster."""
    import ray

    try:
        return RUNTIME_RESOURCE in (ray.get_runtime_context().get_assigned_resources() or {})
    except Exception:  # noqa: BLE001 - the driver, or no Ray: no slot
        return False
