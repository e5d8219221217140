"""Which failures a stage task retries: infrastructure errors, and an SFT that missed its convergence
criterion (`SFTNotConverged`: its retry starts over with another data order, a fresh draw).

A retried stage resumes from its own last checkpoint (the core stages do that when given the same
`out_url`), so retrying is cheap and safe for flaky infrastructure: any `rstar2_core.errors.InfraError`
(an injected fault `RSTAR2_FAULT_INJECT`, a dead engine or trainer actor, a step over
`rl.max_infra_failure_share`, stale engine weights), a Ray worker or actor that died, an
OS/connection/timeout error (a storage read that failed included, botocore's endpoint errors too). Bad config
(`ConfigError`), bad data (`ValueError`, `KeyError`, `TypeError`) and a checkpoint marked complete that
lacks its trainer state (`rstar2_core.errors.CorruptCheckpoint`, a `ValueError`) fail at once: a retry
would only fail again, later.

On Ray the rule sees the same errors as in the flow process. A stage task's error reaches the flow
inside the task's Failed state, pickled by Ray, as its own type (the project's errors pickle with their
message and attributes, rstar2_core/errors.py `PicklableError`). An actor's or remote function's error
reaches its caller as Ray's `RayTaskError`: usually a `RayTaskError(<cause's class>)`, an instance of
both, which the checks below class by the cause's class; where Ray could not build that subclass it is
a plain `RayTaskError`, which the rule classes by its `cause`. Ray's own error classes come from the one
list in rstar2_core/runtime/ray/errors.py (`ray_infra_errors`), which imports Ray only when asked.
"""

from __future__ import annotations

from rstar2_core.errors import InfraError, SFTNotConverged
from rstar2_core.runtime.ray.errors import ray_infra_errors, ray_task_error_cause

_NEVER = (ValueError, KeyError, TypeError, AssertionError)  # ConfigError and CorruptCheckpoint are ValueErrors


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for errors a retry can fix (fault injection, Ray deaths, OS/connection/timeout errors)."""
    if isinstance(exc, (InfraError, SFTNotConverged)):   # injected faults, dead actors, infra share, stale engine
        return True                                       # weights; an SFT draw that missed convergence
    if isinstance(exc, _NEVER):
        return False
    if isinstance(exc, (OSError, ConnectionError, TimeoutError, *_botocore_connection_errors())):
        return True
    cause = ray_task_error_cause(exc)
    if cause is not None:
        return is_infrastructure_error(cause)
    return isinstance(exc, ray_infra_errors())


def _botocore_connection_errors() -> tuple[type[BaseException], ...]:
    """botocore's endpoint errors that are no OSError (`EndpointConnectionError`, `ConnectionClosedError`:
    an S3 endpoint down or dropping connections), when botocore is installed."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:
        return ()
    return (BotoConnectionError, HTTPClientError)


def retry_on_infrastructure_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failed state holds an infrastructure error."""
    exc = state.result(raise_on_failure=False)  # the task's exception, returned instead of raised
    return isinstance(exc, BaseException) and is_infrastructure_error(exc)
