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

from rstar2_core import storage
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
    if isinstance(exc, (OSError, ConnectionError, TimeoutError, *storage.unreachable_errors())):
        return True
    if tracking_unreachable(exc):                       # an MLflow call that did not reach its server
        return True
    cause = ray_task_error_cause(exc)
    if cause is not None:
        return is_infrastructure_error(cause)
    if _undeserializable(exc) is not None:           # a class that does not round-trip pickle: retrying sends
        return False                                 # the same bytes (the retry condition's log names it)
    return isinstance(exc, ray_infra_errors())


_DEFECTS = (TypeError, AttributeError, ImportError)   # what unpickling a class that cannot round-trip raises


def _undeserializable(exc: BaseException) -> str | None:
    """What Ray could not deserialize, when the cause is a defect of the code: a returned value whose
    unpickling raised a TypeError/AttributeError/ImportError (`RaySystemError` carrying it), or a raised
    error Ray could not unpickle (`UnserializableException`, carrying the original traceback). Any other
    cause of a `RaySystemError` (an I/O or memory error while reading the bytes) is left to the infra rule."""
    cause = ray_system_error_cause(exc)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}" if isinstance(cause, _DEFECTS) else None
    if type(exc).__name__ == "UnserializableException" and type(exc).__module__.startswith("ray"):
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        return lines[-1] if lines else "an exception Ray could not unpickle"
    return None


def retry_on_infrastructure_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry only when the failed state holds an infrastructure error."""
    exc = state.result(raise_on_failure=False)  # the task's exception, returned instead of raised
    if not isinstance(exc, BaseException):
        return False
    retry = is_infrastructure_error(exc)
    defect = _undeserializable(exc)
    if defect is not None and not retry:
        print(f"not retried: Ray could not deserialize what the task returned or raised ({defect}); a retry "
              "would send the same bytes. Fix the class the traceback names (a project error must round-trip "
              "pickle: rstar2_core.errors.PicklableError)", file=sys.stderr)
    return retry
