"""Which failures a stage task retries: infrastructure errors, and an SFT that missed its convergence
criterion (`SFTNotConverged`: its retry starts over with another data order, a fresh draw).

Invariant: only errors a retry can fix are retried (any `rstar2_core.errors.InfraError`, a Ray worker or
actor that died, an OS/connection/timeout error, botocore's endpoint errors, an MLflow call that did not
reach its server); bad config, bad data and a
checkpoint marked complete that lacks its trainer state fail at once, since a retry would only fail again,
later. A Ray `RayTaskError` is classed by its cause; Ray's own error classes come from the one list in
rstar2_core/runtime/ray/errors.py (`ray_infra_errors`).
See docs/pipeline.md, "Retries, resume and the UI's Retry".
"""

from __future__ import annotations

import sys

from rstar2_core.errors import InfraError, SFTNotConverged
from rstar2_core.runtime.ray.errors import ray_infra_errors, ray_system_error_cause, ray_task_error_cause
from tasks.tracking import unreachable as tracking_unreachable

_NEVER = (ValueError, KeyError, TypeError, AssertionError)  # ConfigError and CorruptCheckpoint are ValueErrors


def is_infrastructure_error(exc: BaseException) -> bool:
    """True for errors a retry can fix (fault injection, Ray deaths, OS/connection/timeout errors)."""
    if isinstance(exc, (InfraError, SFTNotConverged)):   # injected faults, dead actors, infra share, stale engine
        return True                                       # weights; an SFT draw that missed convergence
    if isinstance(exc, _NEVER):
        return False
    if isinstance(exc, (OSError, ConnectionError, TimeoutError, *_botocore_connection_errors())):
        return True
    if tracking_unreachable(exc):                       # an MLflow call that did not reach its server
        return True
    cause = ray_task_error_cause(exc)
    if cause is not None:
        return is_infrastructure_error(cause)
    unpickled = ray_system_error_cause(exc)          # Ray could not deserialize what a task returned or raised:
    if unpickled is not None:                        # a code defect (retrying sends the same bytes), or an I/O
        return is_infrastructure_error(unpickled)    # error while reading them (retried); the message names it
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
    if not isinstance(exc, BaseException):
        return False
    retry = is_infrastructure_error(exc)
    unpickled = ray_system_error_cause(exc)
    if unpickled is not None and not retry:
        print(f"not retried: Ray could not deserialize what the task returned or raised "
              f"({type(unpickled).__name__}: {unpickled}); a retry would send the same bytes. Fix the class the "
              "traceback names (a project error must round-trip pickle: rstar2_core.errors.PicklableError)",
              file=sys.stderr)
    return retry
