"""Test doubles of the core stage entry points, for testing the orchestration alone (fast, no model).

They follow the contracts in docs/CONTRACTS.md where the pipeline depends on them: artifacts at
`out_url` published atomically with `_COMPLETE`, RL stages that checkpoint every step under `out_url`,
resume from the last step checkpoint, call `maybe_inject_fault(stage.name, step, out_url)` at each step start and
log one metric per step. Every call is appended to $RSTAR2_HOME/calls.jsonl so tests can count them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rstar2_core import storage
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.results import DatasetRef, StageResult


def _note(kind: str, **kw) -> None:
    p = Path(os.environ["RSTAR2_HOME"]) / "calls.jsonl"
    with open(p, "a") as f:
        f.write(json.dumps({"kind": kind, **kw}) + "\n")


def calls(kind: str | None = None) -> list[dict]:
    p = Path(os.environ["RSTAR2_HOME"]) / "calls.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return [r for r in rows if kind is None or r["kind"] == kind]


def _dataset(out_url: str, rows: list[dict]) -> DatasetRef:
    data = "\n".join(json.dumps(r) for r in rows).encode()
    url = storage.join(out_url, "data.jsonl")
    storage.write_bytes_atomic(url, data)
    return DatasetRef(url=url, digest=hashlib.sha256(data).hexdigest(), n_rows=len(rows))


def _checkpoint(url: str, meta: dict) -> str:
    with storage.staging_dir() as d:
        (d / "weights.json").write_text(json.dumps(meta))
        storage.write_dir_atomic(d, url, meta=meta)
    return url


def curate(cfg, out_url, log_metrics=None):
    _note("curate")
    if log_metrics:
        log_metrics({"data/kept": 8.0}, 0)
    return _dataset(out_url, [{"id": i, "problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)])


def build_sft_dataset(cfg, out_url):
    _note("sft_data")
    return _dataset(out_url, [{"messages": [i]} for i in range(4)])


def prepare_base_model(cfg, out_url):
    _note("base_model")
    return _checkpoint(out_url, {"stage": "base", "quality": 0.1})


def run_sft(cfg, *, base_model_url, sft_data_url, out_url, log_metrics=None, resume=True):
    _note("sft")
    for s in range(1, 3):
        if log_metrics:
            log_metrics({"actor/loss": 1.0 / s}, s)
    return StageResult(name="sft", checkpoint_url=_checkpoint(out_url, {"stage": "sft", "quality": 0.2}),
                       metrics={"actor/loss": 0.5}, steps=2)


def run_rl_stage(cfg, stage_index, *, init_checkpoint_url, data_url, out_url, log_metrics=None, resume=True,
                 tracking_run_id=None):
    st = cfg.rl.stages[stage_index]
    steps_dir = storage.join(out_url, "steps")
    done = [u for u in storage.list_dirs(steps_dir) if storage.is_complete(u)] if resume else []
    start = max((int(u.rsplit("-", 1)[1]) for u in done), default=0)
    _note("rl", stage=st.name, start=start, tracking_run_id=tracking_run_id)
    for step in range(start + 1, st.steps + 1):
        maybe_inject_fault(st.name, step, out_url)
        if log_metrics:
            log_metrics({"rollout/reward_mean": step / st.steps}, step)
        _checkpoint(storage.join(steps_dir, f"step-{step:06d}"), {"step": step, "run_id": tracking_run_id})
    quality = 0.3 + 0.1 * stage_index
    url = _checkpoint(storage.join(out_url, "final"), {"stage": st.name, "quality": quality})
    return StageResult(name=st.name, checkpoint_url=url, metrics={"rollout/reward_mean": 1.0}, steps=st.steps,
                       extra={"tracking_run_id": tracking_run_id})


def select_hard_subset(cfg, stage_index, *, checkpoint_url, data_url, out_url):
    _note("hard_subset")
    if data_url.endswith(".parquet"):  # the real curation's output (test_s3_storage)
        from rstar2_core.data.curate import read_dataset

        rows = read_dataset(data_url)
    else:
        rows = [json.loads(x) for x in storage.read_text(data_url).splitlines()]
    return _dataset(out_url, rows[: len(rows) // 2])


def evaluate(cfg, *, checkpoint_url, out_url, benchmarks=None, k=None, log_metrics=None):
    _note("eval", checkpoint_url=checkpoint_url)
    meta = storage.read_json(storage.join(checkpoint_url, storage.COMPLETE_MARKER))
    names = benchmarks or [b.name for b in cfg.eval.benchmarks]
    report = {"benchmarks": {b: {"pass1": meta["quality"], "n": 4} for b in names}}
    storage.write_json_atomic(storage.join(out_url, "report.json"), report)
    return report


ENTRY_POINTS = {k: f"{__name__}:{fn}" for k, fn in {
    "curate": "curate", "sft_data": "build_sft_dataset", "base_model": "prepare_base_model", "sft": "run_sft",
    "rl": "run_rl_stage", "hard_subset": "select_hard_subset", "eval": "evaluate"}.items()}
