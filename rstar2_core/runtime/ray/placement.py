"""Ray placement groups from a `ClusterLayout`, and `ActorGroup`: the stage's actors with one failure
rule and one clean shutdown.

- `create_placement_groups(layout)` reserves one STRICT_PACK group per node (layout.py) and waits for
  them; when the cluster cannot provide them in `timeout_s` it removes what it made and raises
  `PlacementTimeout` listing the free resources (retryable: an autoscaler may still be adding nodes).
- `ActorGroup` owns actors and placement groups. `call_all`/`get` turn any actor death (crash, OOM kill,
  `ray.kill`, lost node) into `ActorFailure` (retryable, errors.py) *after* killing every other actor
  of the group and removing its placement groups, so no process is left holding GPU memory while
  Prefect waits to retry. An actor whose constructor raised a `ValueError`/`TypeError` (bad config) or an
  `ImportError` (a package missing on the node) raises `ActorConfigError` instead (not retried; same
  shutdown first): Ray reports it as a death.
  `wait_ready(names, timeout_s)` waits for actors to be scheduled and constructed and raises
  `ActorStartTimeout` (retryable) naming those still pending, after the same shutdown (an actor Ray
  cannot place in its bundle would otherwise be waited for forever). `shutdown()` does the same on the
  normal path; the group is a context manager.

    with ActorGroup(layout) as group:                       # creates the placement groups
        a = group.spawn("engine-0", EngineActor, args, **engine_actor_options(slot, group.pg(slot.node)))
        group.call_all("ping")
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable
from typing import Any, Self

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rstar2_core.runtime.ray.errors import (
    ActorConfigError,
    ActorFailure,
    ActorStartTimeout,
    PlacementTimeout,
    ray_actor_deaths,
)
from rstar2_core.runtime.ray.layout import ClusterLayout

_ACTOR_DEATHS = ray_actor_deaths()   # the one list: runtime/ray/errors.py


_UNAVAILABLE = tuple(getattr(ray.exceptions, n) for n in ("ActorUnavailableError",) if hasattr(ray.exceptions, n))
# an actor constructor raising these: bad config (vLLM's engine arguments refused in EngineActor), or a node
# image without a package the constructor needs (vLLM): a retry starts the same actor on the same image, so
# they are never retried. TrainerShardActor's constructor only stores its arguments: DeepSpeed's import
# and backend errors come from its `init()` call, as `RayTaskError(<cause>)` from `get` (no death)
_CONFIG_ERRORS = (ValueError, TypeError, ImportError)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def creation_config_error(e: BaseException) -> str | None:
    """`"Type: message"` when `e` is an actor death caused by its constructor raising a ValueError,
    TypeError or ImportError (subclasses included), else None. Ray keeps only the creation task's traceback text
    (`actor_init_failed`, `error_msg`), so the exception's class is read from its last line block and
    resolved by name among the builtins and the modules this process has imported (`_exception_class`);
    an unknown class counts as a real death."""
    if not getattr(e, "actor_init_failed", False):
        return None
    lines = _ANSI.sub("", str(getattr(e, "error_msg", "") or e)).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return None
    tail = [line for line in lines[frames[-1] + 1:] if line and not line.startswith(" ")]
    if not tail:
        return None
    m = re.match(r"([A-Za-z_][\w.]*)(?::|$)", tail[0])
    if m is None:
        return None
    cls = _exception_class(m.group(1))
    if cls is None or not issubclass(cls, _CONFIG_ERRORS):
        return None
    return "\n".join(tail)


def _exception_class(name: str) -> type | None:
    """The exception class a remote traceback names (`ValueError`, `pkg.mod.LayoutError`), from builtins
    or a module this process has already imported; else None. Never imports: the name comes from another
    process's error text, and importing it would run that module's code here (and could raise instead of
    the death being reported)."""
    import builtins

    module, _, attr = name.rpartition(".")
    owner = sys.modules.get(module) if module else builtins
    cls = getattr(owner, attr, None) if owner is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def create_placement_groups(layout: ClusterLayout, timeout_s: float = 600.0,
                            prefix: str = "") -> list[PlacementGroup]:
    """One placement group per node of the layout, ready; `PlacementTimeout` if the cluster lacks them."""
    pgs = [placement_group([b.resources() for b in spec.bundles], strategy=spec.strategy,
                           name=f"{prefix}{spec.name}") for spec in layout.placement_groups]
    deadline = time.monotonic() + timeout_s
    try:
        for pg, spec in zip(pgs, layout.placement_groups):
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                raise PlacementTimeout(
                    f"placement group {spec.name} ({spec.gpus} GPU, {spec.cpus} CPU on one node) was not scheduled "
                    f"within {timeout_s:.0f} s; the cluster has free {ray.available_resources()} of "
                    f"{ray.cluster_resources()}. Add nodes, or shrink cluster.gpus_per_node/cpus_per_node to "
                    "what the nodes have")
    except BaseException:
        remove_placement_groups(pgs)
        raise
    return pgs


def remove_placement_groups(pgs: Iterable[PlacementGroup]) -> None:
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001, S110 - already removed or the cluster is gone; cleanup must not mask the cause
            pass


def kill_and_wait(handle: Any, timeout_s: float = 30.0) -> None:
    """SIGKILL an actor (no restart) and return once its death is visible to callers: `ray.kill` is
    asynchronous, and a call submitted right after it could still be answered by the live process."""
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except _ACTOR_DEATHS:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"actor still answering {timeout_s:.0f} s after ray.kill")


def bundle_strategy(pg: PlacementGroup | None, bundle_index: int) -> dict[str, Any]:
    """Ray options that pin an actor to one bundle (children such as vLLM's TP workers stay in the group)."""
    if pg is None or bundle_index < 0:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True)}


class ActorGroup:
    """Named actors of one stage + the placement groups they live in (see the module docstring)."""

    def __init__(self, layout: ClusterLayout | None = None, *, timeout_s: float = 600.0, prefix: str = ""):
        self.layout = layout
        self.actors: dict[str, Any] = {}
        self.pgs: list[PlacementGroup] = (create_placement_groups(layout, timeout_s, prefix)
                                          if layout is not None else [])

    def pg(self, node: int) -> PlacementGroup | None:
        return self.pgs[node] if self.pgs else None

    def spawn(self, name: str, cls: type, *args: Any, **options: Any):
        """Start `cls` as an actor named `name` with Ray `options` (num_cpus, num_gpus, scheduling...)."""
        if name in self.actors:
            raise ValueError(f"actor name {name!r} is already used in this group")
        remote_cls = cls if hasattr(cls, "remote") else ray.remote(cls)
        handle = remote_cls.options(max_restarts=0, **options).remote(*args)
        self.actors[name] = handle
        return handle

    def get(self, refs: Any, names: list[str] | str, timeout: float | None = None) -> Any:
        """`ray.get` that turns an actor death into `ActorFailure` (a constructor's ValueError/TypeError into
        `ActorConfigError`) after shutting the group down."""
        try:
            return ray.get(refs, timeout=timeout)
        except _ACTOR_DEATHS as e:
            failed = names if isinstance(names, str) else self._dead_name(names)
            self.shutdown()
            config = creation_config_error(e)
            if config is not None:
                raise ActorConfigError(failed, config) from e
            raise ActorFailure(failed, e) from e

    def wait_ready(self, names: list[str], timeout_s: float | None, what: str = "actors") -> None:
        """Wait until the actors `names` are scheduled and constructed (`__init__` returned). A death or a
        constructor error raises at once, as in `get`; actors still pending after `timeout_s` (None: no
        limit) raise `ActorStartTimeout` naming them (retryable), after shutting the group down."""
        pending = {self.actors[n].__ray_ready__.remote(): n for n in names}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                break
            for ref in ready:
                self.get(ref, pending.pop(ref))
        if pending:
            late = sorted(pending.values())
            free, total = ray.available_resources(), ray.cluster_resources()
            self.shutdown()
            raise ActorStartTimeout(late, (
                f"{what} {', '.join(late)} not ready within {timeout_s:.0f} s (cluster.placement_timeout_s): still "
                f"waiting to be scheduled or constructed; the cluster has free {free} of {total}. The stage's "
                "actors were shut down; a retry starts them again. If it repeats: check that each bundle's CPUs "
                "and GPUs fit its actors (cluster.cpus_per_gpu), or raise cluster.placement_timeout_s when "
                "engines load slowly"))

    def _dead_name(self, names: list[str], timeout_s: float = 5.0) -> str:
        """The first of `names` found dead (all of them joined when none is). Every actor is asked
        `__ray_ready__` at once; a live actor busy in a long call (a rank blocked in a collective its dead
        peer never joins) does not answer in time and is not blamed, nor is one only unavailable."""
        asked = {self.actors[n].__ray_ready__.remote(): n for n in names if n in self.actors}
        deadline = time.monotonic() + timeout_s
        while asked:
            ready, _ = ray.wait(list(asked), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                name = asked.pop(ref)
                try:
                    ray.get(ref)
                except _UNAVAILABLE:   # a RayActorError too, but the actor may come back: not a death
                    continue
                except _ACTOR_DEATHS:
                    return name
                except Exception:  # noqa: BLE001, S112 - naming the culprit must not mask the death being raised
                    continue
        return ",".join(names)

    def call_all(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method` on every actor (in spawn order) and wait for all results."""
        names = list(self.actors)
        refs = [getattr(self.actors[n], method).remote(*args) for n in names]
        return self.get(refs, names, timeout=timeout)

    def shutdown(self) -> None:
        """Kill every actor (no restart) and free the placement groups. Idempotent."""
        for handle in self.actors.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already dead; cleanup must not mask the cause
                pass
        self.actors.clear()
        remove_placement_groups(self.pgs)
        self.pgs = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
