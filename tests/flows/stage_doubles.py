"""Test doubles of the core stage functions that tasks/stages.py calls, for testing the orchestration alone
(fast, no model). `install(monkeypatch)` puts them in place of the real ones (`tasks.stages.<name>`).

They follow the contracts in docs/CONTRACTS.md where the pipeline depends on them: artifacts at
`out_url` published atomically with `_COMPLETE`, RL stages that checkpoint every `rl.checkpoint_every` steps
(and at the last) under `out_url/steps/step-NNNNNN`,
resume from the last step checkpoint, call `maybe_inject_fault(stage.name, step, out_url)` at each step start
and log the summary plot's rollout metrics per step at global steps (counted across stages), SFT that logs
`sft/loss`; evaluation returns an `EvalReport` with per-problem rows (checkpoint "quality" q: the first
round(q * N_PROBLEMS) problems solved k/k, the rest 0/k). Every call is appended to
$RSTAR2_HOME/calls.jsonl with the config values it ran with, so tests can count calls and check what
reached the core.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

from rstar2_core import storage
from rstar2_core.eval.metrics import BenchmarkMetrics, EvalReport, ProblemRow
from rstar2_core.faults import maybe_inject_fault
from rstar2_core.results import DatasetRef, StageResult

N_PROBLEMS = 20
K = 4
QUALITY = {"base": 0.1, "sft": 0.2}  # RL stage i: 0.3 + 0.1 * i


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


def curate(cfg, out_url, log_metrics=None, *, sampler=None):
    _note("curate", sampler=sampler is not None)
    if log_metrics:
        log_metrics({"data/kept": 8.0}, 0)
    return _dataset(out_url, [{"id": i, "problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(8)])


def build_sft_dataset(cfg, out_url):
    _note("sft_data")
    return _dataset(out_url, [{"messages": [i]} for i in range(4)])


def prepare_base_model(cfg, out_url):
    _note("base_model")
    return _checkpoint(out_url, {"stage": "base", "quality": QUALITY["base"]})


def run_sft(cfg, *, base_model_url, sft_data_url, out_url, log_metrics=None, resume=True):
    _note("sft", lr=cfg.sft.lr)
    for s in range(1, 3):
        if log_metrics:
            log_metrics({"sft/loss": 1.0 / s}, s)
    return StageResult(name="sft", checkpoint_url=_checkpoint(out_url, {"stage": "sft", "quality": QUALITY["sft"]}),
                       metrics={"actor/loss": 0.5, "sft/converged_step": 2.0}, steps=2)


def run_rl_stage(cfg, stage_index, *, init_checkpoint_url, data_url, out_url, log_metrics=None, resume=True,
                 tracking_run_id=None):
    st = cfg.rl.stages[stage_index]
    steps_dir = storage.join(out_url, "steps")
    done = [u for u in storage.list_dirs(steps_dir) if storage.is_complete(u)] if resume else []
    start = max((int(u.rsplit("-", 1)[1]) for u in done), default=0)
    _note("rl", stage=st.name, start=start, tracking_run_id=tracking_run_id, lr=cfg.rl.lr, steps=st.steps,
          max_turns=st.max_turns)
    offset = sum(s.steps for s in cfg.rl.stages[:stage_index])  # the real stage logs at global steps
    for step in range(start + 1, st.steps + 1):
        maybe_inject_fault(st.name, step, out_url)
        if log_metrics:
            log_metrics({"rollout/reward_mean": step / st.steps, "rollout/pass_rate": step / st.steps,
                         "rollout/pos_tool_error_ratio": 0.5 / step, "rollout/kept_pos_tool_error_ratio": 0.0},
                        offset + step)
        if step % cfg.rl.checkpoint_every == 0 or step == st.steps:  # the real stage's checkpoint rule
            _checkpoint(storage.join(steps_dir, f"step-{step:06d}"), {"step": step, "run_id": tracking_run_id})
    quality = round(0.3 + 0.1 * stage_index, 6)
    url = _checkpoint(storage.join(out_url, "final"), {"stage": st.name, "quality": quality})
    return StageResult(name=st.name, checkpoint_url=url, metrics={"rollout/reward_mean": 1.0,
                                                                   "total/actor/engine_logprob_gap_max": 2e-6},
                       steps=st.steps,
                       extra={"tracking_run_id": tracking_run_id})


def select_hard_subset(cfg, stage_index, *, checkpoint_url, data_url, out_url):
    _note("hard_subset")
    if data_url.endswith(".parquet"):  # the real curation's output (test_s3_storage)
        from rstar2_core.data.curate import read_dataset

        rows = read_dataset(data_url)
    else:
        rows = [json.loads(x) for x in storage.read_text(data_url).splitlines()]
    return _dataset(out_url, rows[: len(rows) // 2])


def fixed_report(checkpoint_url: str, quality: float, benchmarks: list[str], out_url: str | None = None) -> EvalReport:
    """An EvalReport whose first round(quality * N_PROBLEMS) problems are solved k/k (ids p00, p01, ...)."""
    n_ok = round(quality * N_PROBLEMS)
    rows = tuple(ProblemRow(id=f"p{i:02d}", answer="1", n=K, n_correct=K if i < n_ok else 0,
                            pass1=1.0 if i < n_ok else 0.0, pass_k=1.0 if i < n_ok else 0.0,
                            mean_response_tokens=10.0, mean_tool_calls=1.0, tool_errors=0, tool_calls=K, truncated=0,
                            top_answer="1" if i < n_ok else "2", reasons={"correct" if i < n_ok else "wrong": K})
                 for i in range(N_PROBLEMS))
    metrics = {b: BenchmarkMetrics(b, N_PROBLEMS, K, n_ok / N_PROBLEMS, n_ok / N_PROBLEMS, 10.0, 10.0, 1.0, 0.0,
                                   0.0, 0.0, 0) for b in benchmarks}
    report = EvalReport(checkpoint_url, metrics, {b: rows for b in benchmarks},
                        {"k": K, "temperature": 0.6, "top_p": 0.95, "max_turns": 2, "max_tokens": 64, "seed": 0},
                        benchmark_digests={b: "d" * 64 for b in benchmarks})
    if out_url is None:
        return report
    json_url = storage.join(out_url, "report.json")
    report = replace(report, out_url=out_url, json_url=json_url)
    storage.write_json_atomic(json_url, report.to_json())
    return report


def evaluate(cfg, *, checkpoint_url, out_url, benchmarks=None, k=None, log_metrics=None):
    _note("eval", checkpoint_url=checkpoint_url)
    meta = storage.read_json(storage.join(checkpoint_url, storage.COMPLETE_MARKER))
    names = list(benchmarks or [b.name for b in cfg.eval.benchmarks])
    return fixed_report(checkpoint_url, meta["quality"], names, out_url)


DOUBLES = {f.__name__: f for f in (curate, build_sft_dataset, prepare_base_model, run_sft, run_rl_stage,
                                    select_hard_subset, evaluate)}


def install(monkeypatch, keep: tuple[str, ...] = ()) -> None:
    """Replace the core functions tasks/stages.py calls with these doubles, except those named in `keep`."""
    from tasks import stages

    for name, fn in DOUBLES.items():
        if name not in keep:
            monkeypatch.setattr(stages, name, fn)  # raises if tasks/stages.py no longer calls `name`
