"""Ray placement groups from a `ClusterLayout`, and `ActorGroup`: the stage's actors with one failure
rule and one clean shutdown.

`create_placement_groups(layout)` reserves the layout's groups all or none (gang placement: a layout no
set of live nodes can hold raises `LayoutDoesNotFit` at once; one not placed in time, `PlacementTimeout`).
Invariant: an actor death kills every other actor of the `ActorGroup` and removes its placement groups
*before* the error (`ActorFailure`, `NodeLost`, `ActorConfigError`, `ActorStartTimeout`) propagates, so
nothing holds a GPU while Prefect waits to retry. See docs/ray-runtime.md, "Placement".

    with ActorGroup(layout) as group:                       # creates the placement groups
        a = group.spawn("engine-0", EngineActor, args, **engine_actor_options(slot, group.pg(slot.node)))
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, Self

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rstar2_core.runtime.layout import ClusterLayout, NodeResources, describe_nodes, fit_layout
from rstar2_core.runtime.ray.errors import (
    ActorConfigError,
    ActorFailure,
    ActorStartTimeout,
    LayoutDoesNotFit,
    NodeLost,
    PlacementTimeout,
    ray_actor_deaths,
)

_ACTOR_DEATHS = ray_actor_deaths()   # the one list: runtime/ray/errors.py


_UNAVAILABLE = tuple(getattr(ray.exceptions, n) for n in ("ActorUnavailableError",) if hasattr(ray.exceptions, n))
# an actor constructor raising these: bad config (vLLM's engine arguments refused in EngineActor), or a node
# image without a package the constructor needs (vLLM): a retry starts the same actor on the same image, so
# they are never retried. TrainerShardActor's constructor only stores its arguments: DeepSpeed's import
# and backend errors come from its `init()` call, as `RayTaskError(<cause>)` from `get` (no death)
_CONFIG_ERRORS = (ValueError, TypeError, ImportError)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE_DEATHS = tuple(getattr(ray.exceptions, n) for n in ("NodeDiedError", "LocalRayletDiedError")
                     if hasattr(ray.exceptions, n))
REFIT_EVERY_S = 5.0
"""While the gang waits to be placed, how often the layout is fitted to the live nodes again (a node lost
meanwhile makes it unplaceable: `LayoutDoesNotFit` then, not at the end of the timeout)."""
NODE_DEATH_WAIT_S = 60.0
"""How long an actor call that failed as its node went away waits for Ray to declare the node dead (to
raise `NodeLost` naming it rather than a plain `ActorFailure`)."""


def _node_id(_actor: Any) -> str:
    """Run inside an actor (`__ray_call__`): the id of the node it runs on."""
    return ray.get_runtime_context().get_node_id()


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


def may_be_node_loss(e: BaseException) -> bool:
    """Whether an actor death may be its node's: the call could not reach the actor (`ActorUnavailableError`:
    what a vanished node looks like for the seconds before Ray's verdict), Ray says the node died, or
    the death names it ("its node has died"). Never a constructor's error (`actor_init_failed`)."""
    if getattr(e, "actor_init_failed", False):
        return False
    return isinstance(e, _UNAVAILABLE + _NODE_DEATHS) or "node has died" in str(e).lower()


def _lost_nodes(nodes: dict[str, str], e: BaseException, wait_s: float = NODE_DEATH_WAIT_S) -> dict[str, list[str]]:
    """{dead node's label: the actors it held} for the nodes in `nodes` (actor -> node id) that Ray reports
    dead. An actor call fails a few seconds after its node goes away (the connection drops), well before
    Ray's health check declares the node dead (~15 s by default: `health_check_period_ms` x
    `health_check_failure_threshold`), so when `may_be_node_loss(e)` this waits up to
    `wait_s` (`cluster.node_death_wait_s`) for the verdict; any other death is checked once, without waiting."""
    try:
        dead = _dead_nodes(set(nodes.values()), wait_s if may_be_node_loss(e) else 0.0)
    except Exception:  # noqa: BLE001 - naming the node must not mask the death being raised
        return {}
    return {f"node {nid[:8]} ({n.get('NodeManagerAddress', '?')})": sorted(a for a, x in nodes.items() if x == nid)
            for nid, n in dead.items()}


def _dead_nodes(ids: set[str], wait_s: float) -> dict[str, dict]:
    """{node id: Ray's record} of the nodes of `ids` that Ray reports dead, polling up to `wait_s` until
    one is ({} if none by then)."""
    deadline = time.monotonic() + wait_s
    while ids:
        dead = {n["NodeID"]: n for n in ray.nodes() if not n.get("Alive") and n["NodeID"] in ids}
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.25)
    return {}


def live_nodes() -> list[NodeResources]:
    """The cluster's live nodes with their total and free resources (Ray's `ray.nodes()` and the per-node
    free resources of its state API), the head first."""
    from ray._private.state import available_resources_per_node  # what `ray status` prints per node

    free = available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {k: float(v) for k, v in (n.get("Resources") or {}).items() if not k.startswith("node:")}
        out.append(NodeResources(n["NodeID"], n.get("NodeManagerAddress", "?"), res,
                                 {k: float(v) for k, v in (free.get(n["NodeID"]) or {}).items()},
                                 "node:__internal_head__" in (n.get("Resources") or {})))
    return sorted(out, key=lambda x: (not x.head, x.node_id))


def create_placement_groups(layout: ClusterLayout, timeout_s: float = 600.0,
                            prefix: str = "") -> list[PlacementGroup]:
    """The layout's placement groups, all or none (gang placement; see the module docstring)."""
    nodes = live_nodes()
    fit = fit_layout(layout, nodes)
    if not fit.fits:
        raise LayoutDoesNotFit(list(fit.problems), describe_nodes(nodes))
    pgs: list[PlacementGroup] = []
    deadline = time.monotonic() + timeout_s
    try:
        for spec in layout.placement_groups:       # inside the try: one that fails to be created frees the rest
            pgs.append(placement_group([b.resources() for b in spec.bundles], strategy=spec.strategy,
                                       name=f"{prefix}{spec.name}"))
        pending = [pg.ready() for pg in pgs]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(REFIT_EVERY_S, left))
            if pending:                 # a node lost meanwhile can make the gang unplaceable: fail fast
                nodes = live_nodes()
                fit = fit_layout(layout, nodes)
                if not fit.fits:
                    raise LayoutDoesNotFit(list(fit.problems), describe_nodes(nodes))
        if pending:
            late = [spec.name for pg, spec in zip(pgs, layout.placement_groups) if not _is_ready(pg)]
            now = live_nodes()
            raise PlacementTimeout(
                f"placement groups {', '.join(late)} of the layout were not scheduled within {timeout_s:.0f} s "
                "(cluster.placement_timeout_s), all of them were removed: the cluster can hold the layout but "
                "not now (another job holds resources, or a node is still joining). Free now: "
                + "; ".join(describe_nodes(now))
                + ("; " + " ".join(fit_layout(layout, now, free_only=True).problems) if now else ""))
    except BaseException:
        remove_placement_groups(pgs)
        raise
    return pgs


def _is_ready(pg: PlacementGroup) -> bool:
    try:
        return ray.util.placement_group_table(pg).get("state") == "CREATED"
    except Exception:  # noqa: BLE001 - only used to name the late groups
        return False


RUNTIME_GROUP_PREFIX = "rt-"
"""Name prefix of a runtime's placement groups (`RayRuntime`: `rt-<6 hex>-<group name>`)."""
_LIVE_STATES = ("CREATED", "PENDING", "RESCHEDULING")


def remove_stale_runtime_groups(own_prefix: str, holds_slot: bool) -> list[str]:
    """Remove the live `rt-*` placement groups that are not `own_prefix`'s, when this process holds the
    runtime slot (`holds_slot`: connect.holds_runtime_slot()); returns their names.

    A stage task killed by the OS or Ray's memory monitor leaves its groups behind: they live as long
    as the job (the flow's driver), not the task, and hold the GPUs, so the task's retry would wait for
    its own gang until `cluster.placement_timeout_s`. Only one process holds the slot, so while it does
    every other runtime group is a leftover. Without the slot (a driver, a test) nothing is removed."""
    if not holds_slot:
        return []
    from ray.util.placement_group import placement_group_table

    stale = [(v["name"], v["placement_group_id"]) for v in placement_group_table().values()
             if v.get("name", "").startswith(RUNTIME_GROUP_PREFIX) and not v["name"].startswith(own_prefix)
             and v.get("state") in _LIVE_STATES]
    for _, pg_id in stale:
        remove_placement_groups([PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))])
    return sorted(name for name, _ in stale)


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


def wait_node_dead(node_id: str, timeout_s: float = NODE_DEATH_WAIT_S) -> None:
    """Return once Ray reports node `node_id` dead (its health check: seconds); `TimeoutError` after
    `timeout_s`."""
    if not _dead_nodes({node_id}, timeout_s):
        raise TimeoutError(f"node {node_id[:8]} still alive {timeout_s:.0f} s after its raylet was killed")


def bundle_strategy(pg: PlacementGroup | None, bundle_index: int) -> dict[str, Any]:
    """Ray options that pin an actor to one bundle (children such as vLLM's TP workers stay in the group)."""
    if pg is None or bundle_index < 0:
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True)}


class ActorGroup:
    """Named actors of one stage + the placement groups they live in (see the module docstring)."""

    def __init__(self, layout: ClusterLayout | None = None, *, timeout_s: float = 600.0, prefix: str = "",
                 node_death_wait_s: float = NODE_DEATH_WAIT_S):
        self.layout = layout
        self.node_death_wait_s = node_death_wait_s
        self.actors: dict[str, Any] = {}
        self.nodes: dict[str, str] = {}     # actor name -> the id of the node it runs on (once ready)
        self._lock = threading.RLock()      # a pipelined stage's update thread and event loop can both fail it
        self._failed: BaseException | None = None
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
        """`ray.get` that turns an actor death into the error `failure` returns (`ActorFailure`, `NodeLost`,
        `ActorConfigError`) after shutting the group down."""
        try:
            return ray.get(refs, timeout=timeout)
        except _ACTOR_DEATHS as e:
            raise self.failure(names if isinstance(names, str) else self._dead_name(names), e) from e

    def failure(self, failed: str, e: BaseException) -> ActorFailure | ActorConfigError:
        """The error to raise for the death `e` of actor(s) `failed`, after shutting the group down:
        `ActorConfigError` (its constructor refused its config), `NodeLost` (a node of the group died:
        named with the actors it held), else `ActorFailure`. The group is shut down first (no survivor
        keeps its GPUs while the node's fate is awaited); a second caller (another thread that saw the
        same loss) gets the first caller's error."""
        with self._lock:
            if self._failed is not None:
                return self._failed
            nodes = dict(self.nodes)
            self.shutdown()
            config = creation_config_error(e)
            if config is not None:
                self._failed = ActorConfigError(failed, config)
                return self._failed
            lost = _lost_nodes(nodes, e, self.node_death_wait_s)
            self._failed = NodeLost(lost, e) if lost else ActorFailure(failed, e)
            return self._failed

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
        if not pending:
            ids = self.get([self.actors[n].__ray_call__.remote(_node_id) for n in names], names)
            self.nodes.update(zip(names, ids))
            return
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
        """Kill every actor (no restart) and free the placement groups. Idempotent, thread-safe."""
        with self._lock:
            handles, pgs = list(self.actors.values()), self.pgs
            self.actors.clear()
            self.nodes.clear()
            self.pgs = []
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already dead; cleanup must not mask the cause
                pass
        remove_placement_groups(pgs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
