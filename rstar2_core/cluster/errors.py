"""Typed errors of the cluster layer (no ray import, so callers can catch them without Ray).

`ActorFailure` is what any call into a cluster actor raises when the actor died, was killed, or its
node went away. It is an `rstar2_core.errors.InfraError` (a `ConnectionError`): the pipeline's retry
rule (tasks/retry.py) retries it without importing this module, the agent loop lets it through instead
of marking one trajectory as infra-failed (a dead actor ends the step), and a retried stage resumes
from its last checkpoint. `PlacementTimeout` (a `TimeoutError`, also retried) means the cluster did not have the
resources of a placement group in time, e.g. while an autoscaler adds nodes; `ActorStartTimeout` (also a
`TimeoutError`, retried) that actors were not scheduled and constructed in time, naming them.

The errors with constructor arguments (`ActorFailure`, `ActorStartTimeout`, `ActorConfigError`) are
`PicklableError`s: raised in a stage task on a Ray worker, they reach the flow with their type, message
and attributes (a cause that cannot be pickled travels as its "Type: message").
"""

from __future__ import annotations

from rstar2_core.errors import InfraError, PicklableError


class ActorFailure(InfraError):
    """A Ray actor of the stage (engine, trainer shard, sandbox) died or became unreachable."""

    def __init__(self, actor: str, cause: BaseException | str):
        self.actor = actor
        self.cause = cause
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        super().__init__(f"cluster actor {actor} failed: {what.rstrip('.')}. The stage's actors were shut down; "
                         "a retry resumes from the last checkpoint")


class ActorStartTimeout(PicklableError, TimeoutError):
    """Actors of the stage were not ready (scheduled and constructed) in time; `actors` lists them."""

    def __init__(self, actors: list[str], message: str):
        self.actors = list(actors)
        super().__init__(message)


class PlacementTimeout(TimeoutError):
    """A placement group was not scheduled in time; the message lists what the cluster has free."""


class ActorConfigError(PicklableError, ValueError):
    """A Ray actor of the stage could not start: its constructor raised a ValueError/TypeError (bad config
    or arguments) or an ImportError (a package missing on the node), so a retry would fail the same way. `error` is the constructor's `Type: message`."""

    def __init__(self, actor: str, error: str):
        self.actor = actor
        self.error = error
        super().__init__(f"cluster actor {actor} could not start: its constructor raised {error}. This is a "
                         "configuration error, not retried; the stage's actors were shut down")
