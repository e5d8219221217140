"""Per-recipe-run state: where each stage writes, and which stages are already done.

A recipe run (one Prefect flow run of `full_recipe`, keyed by its flow-run id, or an explicit `run_id`)
owns `<storage root>/runs/<run_id>/` (data/, checkpoints/, eval/, state/). Invariant: a stage is done only
when its `state/<stage>.json` exists and every checkpoint/dataset it names is still there (checkpoints
with their `_COMPLETE` marker), so the UI's Retry of the same flow run id skips finished stages. The store
lives beside the artifacts (file:// or s3://), so a worker on another machine finds it.
See docs/pipeline.md, "Storage" (the layout) and "Finished stages are reused".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rstar2_core import storage
from rstar2_core.eval.metrics import EvalReport
from rstar2_core.results import DatasetRef, StageResult

_KINDS: dict[str, Any] = {"dataset": DatasetRef, "stage": StageResult, "eval_report": EvalReport}


@dataclass(frozen=True)
class RunStore:
    """Locations and finished-stage records of one recipe run rooted at `root` (an fsspec URL)."""

    root: str
    run_id: str

    @classmethod
    def for_run(cls, storage_root: str, run_id: str) -> RunStore:
        return cls(root=storage.join(storage_root, "runs", run_id), run_id=run_id)

    def url(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def _record_url(self, stage: str, untracked: bool = False) -> str:
        return self.url("state", "untracked", f"{stage}.json") if untracked else self.url("state", f"{stage}.json")

    # finished stages -----------------------------------------------------------------------------
    def save(self, stage: str, result: Any, attempt: int = 1, untracked: bool = False) -> None:
        """Record a finished stage (`DatasetRef`, `StageResult`, `EvalReport` or a JSON-able dict).
        `untracked`: its result, computed while MLflow was away, which the retry logs and then records
        (`state/untracked/<stage>.json`; the stage is not done until it is recorded)."""
        kind = next((k for k, t in _KINDS.items() if isinstance(result, t)), "json")
        payload = result.to_json() if kind != "json" else result
        storage.write_json_atomic(self._record_url(stage, untracked), {
            "stage": stage, "kind": kind, "result": payload, "attempt": attempt,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    def untracked_url(self, stage: str) -> str:
        return self._record_url(stage, untracked=True)

    def drop_untracked(self, stage: str) -> None:
        """Remove the stage's untracked result (once it is logged and recorded)."""
        if storage.exists(url := self._record_url(stage, untracked=True)):
            storage.remove(url)

    def record(self, stage: str, untracked: bool = False) -> dict | None:
        """The raw record of a finished stage, or None."""
        url = self._record_url(stage, untracked)
        return storage.read_json(url) if storage.exists(url) else None

    def load(self, stage: str, untracked: bool = False) -> Any | None:
        """The finished stage's result when it and everything it points to is still complete, else None."""
        rec = self.record(stage, untracked)
        if rec is None:
            return None
        kind, payload = rec["kind"], rec["result"]
        result = _from_json(kind, payload)
        return result if _artifacts_present(result) else None

    # the run's config snapshot (tasks/run_config.py) ----------------------------------------------
    def config_url(self) -> str:
        return self.url("state", "config.json")

    def read_config_snapshot(self) -> dict | None:
        """The snapshot record written when the run opened, or None before that."""
        url = self.config_url()
        return storage.read_json(url) if storage.exists(url) else None

    def write_config_snapshot(self, record: dict) -> dict:
        """Write the snapshot record unless one exists; return the one the run uses (written once)."""
        have = self.read_config_snapshot()
        if have is not None:
            return have
        storage.write_json_atomic(self.config_url(), record)
        return record

    def record_open_failure(self, attempt: int, error: BaseException) -> str | None:
        """Note that attempt `attempt` failed before it froze the run's config (so that a retry can tell
        "no snapshot yet" from "the snapshot is in another store"). Best effort, the store may be what
        failed: returns why the note could not be written, else None."""
        try:
            storage.write_json_atomic(self.url("state", "open-failure.json"), {
                "attempt": attempt, "error": f"{type(error).__name__}: {error}"[:2000],
                "failed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        except Exception as e:  # noqa: BLE001 - the attempt's own error is the one the caller raises
            return f"{type(e).__name__}: {e}"
        return None

    def open_failure(self) -> dict | None:
        """The record of an attempt that failed before writing the snapshot, or None."""
        url = self.url("state", "open-failure.json")
        return storage.read_json(url) if storage.exists(url) else None

    # tracking ids (one file per key: evaluations of several stages may run at once) ---------------
    def tracking_id(self, key: str) -> str | None:
        """MLflow run id stored for `key` ("parent" or a stage name), or None."""
        url = self.url("state", "mlflow", f"{key}.json")
        return storage.read_json(url)["run_id"] if storage.exists(url) else None

    def set_tracking_id(self, key: str, run_id: str) -> None:
        storage.write_json_atomic(self.url("state", "mlflow", f"{key}.json"), {"run_id": run_id})


def _from_json(kind: str, payload: Any) -> Any:
    if kind == "eval_report":
        return EvalReport.from_json(payload)
    return _KINDS[kind](**payload) if kind in _KINDS else payload


def _artifacts_present(result: Any) -> bool:
    if isinstance(result, EvalReport):
        return result.json_url is None or storage.exists(result.json_url)
    if isinstance(result, StageResult):
        return storage.is_complete(result.checkpoint_url)
    if isinstance(result, DatasetRef):
        return storage.exists(result.url)
    if isinstance(result, dict) and isinstance(result.get("checkpoint_url"), str):
        return storage.is_complete(result["checkpoint_url"])
    return True
