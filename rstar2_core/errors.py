"""Errors that cross layers: what the pipeline may retry, and why a stage stopped.

`InfraError` (a `ConnectionError`) is the one base of "the infrastructure failed, not the config, the
data or the model": tasks/retry.py retries it without knowing its subclasses, and a retried stage
resumes from its last complete checkpoint. Bad input (`ConfigError`, `CorruptCheckpoint`,
`StageTrainedNothing`: `ValueError`s) is never retried. Invariant: every error class round-trips pickle
with its type, message and attributes (`PicklableError`; tests/unit/test_error_pickling.py), since a
stage's failure reaches the flow pickled. See docs/runtime.md, "Errors: what is retried, and how they
travel".
"""

from __future__ import annotations

import pickle
from typing import Any


class PicklableError:
    """Mixin for an exception whose `__init__` takes other arguments than its `args`: it pickles as its
    type, `args` and attribute dict and unpickles without calling `__init__`, so the copy has the same
    message and attributes whatever the constructor's signature. Put it before the builtin base
    (`class ActorFailure(PicklableError, ConnectionError)`).

    An attribute that does not survive a pickle round trip itself (an exception holding a lock or a
    socket, one whose own class cannot be unpickled) travels as `"Type: message"` (`repr` for other
    objects): the copy keeps what a reader needs, not the object. The trade-off: `__init__` does not run
    on the copy, so an error class must keep all its state in `args` and attributes (nothing computed
    lazily from constructor arguments it did not store)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        state = {k: _portable(v) for k, v in vars(self).items()}
        return _restore, (type(self), self.args, state)


def _restore(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


def _portable(value: Any) -> Any:
    """`value` if it comes back from pickling, else `"Type: message"` for an exception, `repr` otherwise."""
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001 - whatever pickling raises, the error itself must still travel
        return f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else repr(value)
    return value


class InfraError(PicklableError, ConnectionError):
    """The infrastructure failed; a retry of the stage resumes from its last complete checkpoint."""


class InfraFailureShareExceeded(InfraError):
    """More of a step's trajectories (or of an evaluation's, or a hard-subset selection's, samples) failed
    for infrastructure reasons (engine errors, sandbox internal errors or overload, grader timeouts or
    errors) than `rl.max_infra_failure_share` / `eval.max_infra_failure_share` allows: training on what
    is left would train on a biased remainder, or on nothing, and a measurement would measure the outage."""


class GraderUnavailable(InfraError):
    """No grader worker became ready within the pool's start timeout (an overloaded or starting node);
    workers that die at import (a broken install) raise `RuntimeError` instead: retrying does not fix it."""


class StaleEngineWeights(InfraError):
    """The engines' sampling log-probs differ from the trainer's recomputed ones by more than
    `rl.max_engine_logprob_gap`: after a weight sync the engines serve other weights than the trainer
    holds (the failure TRL issue #5312 describes for sleep-mode engines)."""


class StoreUnavailable(InfraError):
    """The artifact store (S3, a network file system) did not answer a read or write for longer than
    `storage.outage_retry_s`, through every retry (rstar2_core/storage.py). Retryable: the stage's retry
    resumes from its last complete checkpoint; nothing half-written is marked complete."""

    def __init__(self, what: str, url: str, tries: int, waited_s: float, budget_s: float, cause: BaseException):
        self.what, self.url, self.tries, self.waited_s, self.budget_s = what, url, tries, waited_s, budget_s
        self.cause = cause
        super().__init__(f"the store did not answer while it {what} {url}: {type(cause).__name__}: "
                         f"{str(cause)[:300]} (retried {tries} times over {waited_s:.0f} s; "
                         f"storage.outage_retry_s = {budget_s:g} s). Check the endpoint "
                         "(storage.s3_endpoint_url) and its credentials; a retry of the stage resumes from its "
                         "last complete checkpoint")


class ToolServiceUnavailable(InfraError):
    """The tool service (`sandbox.backend = "service"`) did not answer its health check within
    `sandbox.service.ready_timeout_s` at a stage's start, or is not deployed: retryable, since a retry
    finds it once it is back. The message names the address tried and how to deploy or check it."""


class ToolServiceRefused(RuntimeError):
    """The tool service's replicas cannot confine calls on their host (namespaces, mount or seccomp denied):
    the message names the cause and the manifest setting that fixes it. Not retried: the host must change."""


class CorruptCheckpoint(ValueError):
    """A checkpoint marked complete lacks what resuming from it needs (the RL or SFT trainer state, a
    rank's optimizer state). Deterministic: the message names the checkpoint and the fix (delete it, and
    the stage resumes from the previous one or starts again); never retried (tasks/retry.py)."""


class SFTNotConverged(PicklableError, RuntimeError):
    """SFT ran its last step (`sft.max_steps` or its passes) without meeting `sft.converged_loss`: the
    message names the measured loss, the threshold and the steps. Retried (tasks/retry.py): the stage
    keeps no step checkpoint of the failed draw, and the retry starts SFT over with another data order
    (`SFT_DRAW_SEED_STRIDE`), a fresh chance at the phase change the tiny model's SFT depends on; no
    `final/` is written, so nothing downstream trains on the unconverged policy."""

    def __init__(self, message: str, loss: float, threshold: float, steps: int, draw: int):
        self.loss, self.threshold, self.steps, self.draw = loss, threshold, steps, draw
        super().__init__(message)


class StageTrainedNothing(ValueError):
    """An RL stage ran all its steps and took no optimizer step: every group of every step was dropped
    (all rollouts right, all wrong, or too few valid), so the policy left the stage as it came in.
    Deterministic (seeded rollouts give the same groups again): never retried; the message gives the
    stage's group counts and the fixes. The step checkpoints stay; `final/` is not written."""


class AttentionKernelMismatch(PicklableError, ValueError):
    """The trainer's start-up comparison of the attention kernels (rstar2_core/models/kernel_check.py): on
    its first micro-batch the flex kernel's loss or gradient norms differ from the per-segment kernel's by
    more than rounding explains. Deterministic (the same weights and data give the same kernels' figures):
    never retried; the message names `model.attention_kernel` and the fix (`"segments"`); `figures` holds
    the comparison's metrics."""

    def __init__(self, message: str, figures: dict[str, float]):
        self.figures = figures
        super().__init__(message)
