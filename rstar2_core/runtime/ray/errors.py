"""The Ray backend's errors: its own typed errors, and the one list of Ray's infrastructure errors.

`ray_actor_deaths()` (an actor or its process gone) and `ray_infra_errors()` (those, plus lost objects,
system errors, OOM kills and get timeouts: what tasks/retry.py retries) are the only lists of Ray's
exception classes in the project; `ray_task_error_cause` unwraps a plain `RayTaskError`. `ActorFailure`,
`NodeLost` and `LayoutDoesNotFit` are `InfraError`s, `PlacementTimeout`, `ActorStartTimeout` and
`ModelDownloadTimeout` `TimeoutError`s (all retried), `ActorConfigError` a `ValueError` (not). Invariant: Ray is imported inside
the functions only, so the retry rule imports this module without Ray.
See docs/runtime.md, "Errors: what is retried, and how they travel".
"""

from __future__ import annotations

from functools import cache

from rstar2_core.errors import InfraError, PicklableError

_ACTOR_DEATH_NAMES = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                      "NodeDiedError", "OwnerDiedError", "LocalRayletDiedError")
_OTHER_INFRA_NAMES = ("ObjectLostError", "RaySystemError", "OutOfMemoryError", "GetTimeoutError")


def _ray_exceptions(names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    try:
        from ray import exceptions as rex
    except ImportError:  # ray is a dependency, but the retry rule must not need it
        return ()
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


@cache
def ray_actor_deaths() -> tuple[type[BaseException], ...]:
    """Ray's errors for an actor or its process gone (names this Ray version lacks are skipped)."""
    return _ray_exceptions(_ACTOR_DEATH_NAMES)


@cache
def ray_infra_errors() -> tuple[type[BaseException], ...]:
    """Every Ray error a retry can fix: the actor deaths, lost objects, Ray system errors, OOM kills and
    get timeouts."""
    return ray_actor_deaths() + _ray_exceptions(_OTHER_INFRA_NAMES)


def ray_task_error_cause(exc: BaseException) -> BaseException | None:
    """The user exception a plain `RayTaskError` wraps (None for anything else, a dual subclass included:
    it is already an instance of its cause's class)."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:
        return None
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, BaseException) and not isinstance(exc, type(cause)):
        return cause
    return None


def ray_system_error_cause(exc: BaseException) -> BaseException | None:
    """The exception behind a `RaySystemError` that Ray raised because it could not deserialize a result
    or an error (its `client_exc`: e.g. a `TypeError` from an exception class whose `__init__` needs other
    arguments than its `args`); None for anything else, a system error given as text included (a raylet
    gone, a worker that did not start: infrastructure)."""
    try:
        from ray.exceptions import RaySystemError
    except ImportError:
        return None
    cause = getattr(exc, "client_exc", None)
    return cause if isinstance(exc, RaySystemError) and isinstance(cause, BaseException) else None


class ActorFailure(InfraError):
    """A Ray actor of the stage (engine, trainer shard, sandbox) died or became unreachable."""

    def __init__(self, actor: str, cause: BaseException | str):
        self.actor = actor
        self.cause = cause
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        super().__init__(f"cluster actor {actor} failed: {what.rstrip('.')}. The stage's actors were shut down; "
                         "a retry resumes from the last checkpoint")


class NodeLost(ActorFailure):
    """A Ray node that held some of the stage's actors died (its raylet stopped: a crash, a preempted or
    rebooted machine, a lost network). `nodes` maps each lost node's label to the actors it held. Retried
    like any actor death: the retry's placement either fits (the node is back, or another has its
    resources) and resumes from the last checkpoint, or fails fast with `LayoutDoesNotFit`."""

    def __init__(self, nodes: dict[str, list[str]], cause: BaseException | str):
        self.nodes = {k: list(v) for k, v in nodes.items()}
        self.actor = ",".join(a for v in self.nodes.values() for a in v)
        self.cause = cause
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        lost = "; ".join(f"{k} held {', '.join(v) or 'no actor of the stage'}" for k, v in self.nodes.items())
        InfraError.__init__(self, f"Ray node lost mid-step: {lost} ({what.splitlines()[0].rstrip('.')}). The "
                            "stage's other actors were shut down and its placement groups removed; a retry "
                            "resumes from the last checkpoint once the layout fits the cluster again")


class LayoutDoesNotFit(InfraError):
    """The live cluster cannot hold the layout's placement groups at all (not: not now). Raised before any
    group is created, or while they wait when a node is lost meanwhile (they are removed), instead of
    waiting for resources no node has; the message names, per node, what it lacks. Retried: after a lost
    node its restart makes a retry fit, if it comes back within the retries (`pipeline.task_retries` x
    `pipeline.retry_delay_s`); a layout larger than the cluster fails the same way on each attempt."""

    def __init__(self, problems: list[str], nodes: list[str]):
        self.problems, self.node_lines = list(problems), list(nodes)
        super().__init__("the layout does not fit the live Ray cluster: " + " ".join(self.problems)
                         + ". Live nodes: " + "; ".join(self.node_lines) + ". Start or add the missing nodes, or "
                         "shrink cluster.nodes / gpus_per_node / cpus_per_node to what they have (`rstar2 plan "
                         "--address <cluster>` checks a layout against a live cluster)")


class ActorStartTimeout(PicklableError, TimeoutError):
    """Actors of the stage were not ready (scheduled and constructed) in time; `actors` lists them."""

    def __init__(self, actors: list[str], message: str):
        self.actors = list(actors)
        super().__init__(message)


class PlacementTimeout(TimeoutError):
    """A placement group was not scheduled in time; the message lists what the cluster has free."""


class ModelDownloadTimeout(PicklableError, TimeoutError):
    """Nodes of the layout did not hold the remote model in their cache within
    `cluster.model_download_timeout_s`; `nodes` maps each late node's label to (bytes arrived, bytes in all)."""

    def __init__(self, url: str, nodes: dict[str, tuple[int, int]], timeout_s: float):
        self.url, self.nodes, self.timeout_s = url, dict(nodes), timeout_s
        late = "; ".join(f"{k}: {got:,} of {total:,} bytes" for k, (got, total) in self.nodes.items())
        super().__init__(f"{url} did not reach every node within {timeout_s:.0f} s (cluster.model_download_timeout_s): "
                         f"{late}. The downloads were stopped and the stage's placement groups removed; a retry "
                         "downloads again from the start (raise the timeout for a slow store or link)")


class ActorConfigError(PicklableError, ValueError):
    """A Ray actor of the stage could not start: its constructor raised a ValueError/TypeError (bad config
    or arguments) or an ImportError (a package missing on the node), so a retry would fail the same way. `error` is the constructor's `Type: message`."""

    def __init__(self, actor: str, error: str):
        self.actor = actor
        self.error = error
        super().__init__(f"cluster actor {actor} could not start: its constructor raised {error}. This is a "
                         "configuration error, not retried; the stage's actors were shut down")
