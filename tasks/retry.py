"""Which failures a stage task retries: infrastructure errors only.

A retried stage resumes from its own last checkpoint (the core stages do that when given the same
`out_url`), so retrying is cheap and safe for flaky infrastructure: any `rstar2_core.errors.InfraError`
(an injected fault `RSTAR2_FAULT_INJECT`, a dead engine or trainer actor, a step over
`rl.max_infra_failure_share`, stale engine weights), a Ray worker or actor that died, an
OS/connection/timeout error (a storage read that failed included). Bad config
(`ConfigError`), bad data (`ValueError`, `KeyError`, `TypeError`) and a checkpoint marked complete that
lacks its trainer state (`rstar2_core.errors.CorruptCheckpoint`, a `ValueError`) fail at once: a retry
would only fail again, later.
"""

from __future__ import annotations

from rstar2_core.errors import InfraError

_NEVER = (ValueError, KeyError, TypeError, AssertionError)  # ConfigError and CorruptCheckpoint are ValueErrors


def _ray_infra_errors() -> tuple[type[BaseException], ...]:
    try:
        from ray import exceptions as rex
    except ImportError:  # ray is a dependency, but the retry rule must not need it
        return ()
    # a superset of rstar2_core/cluster/placement.py `_ACTOR_DEATHS` (what the cluster layer treats as an
    # actor death; tests/unit/cluster/test_placement.py checks it), plus lost objects, system errors, OOM
    # kills and get timeouts
    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "ActorDiedError",
             "ActorUnavailableError", "ObjectLostError", "OwnerDiedError", "RaySystemError",
             "LocalRayletDiedError", "OutOfMemoryError", "GetTimeoutError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for errors a retry can fix (fault injection, Ray deaths, OS/connection/timeout errors)."""
    if isinstance(exc, InfraError):   # injected faults, dead actors, infra-failure share, stale engine weights
        return True
    if isinstance(exc, _NEVER):
        return False
    return isinstance(exc, (OSError, ConnectionError, TimeoutError, *_ray_infra_errors()))


def retry_on_infrastructure_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failed state holds an infrastructure error."""
    exc = state.result(raise_on_failure=False)  # the task's exception, returned instead of raised
    return isinstance(exc, BaseException) and is_infrastructure_error(exc)
