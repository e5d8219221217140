"""Stages with `rollout.engine = "vllm"` (the real CPU build), each building its engines through the runtime:

- the RL stage on the local runtime: engine/trainer log-prob gaps stay at float32 noise; a `stale-weights`
  fault (engine 0 serving other weights) stops the step with StaleEngineWeights through
  `rl.max_engine_logprob_gap`, and the retry resumes and finishes the stage;
- the RL stage on the Ray runtime: a vLLM engine actor beside two DeepSpeed trainer shards and the sandbox
  pool, weights pushed through the object store;
- the asynchronous RL stage (`rl.max_staleness = 1`) on the local runtime: weights pushed between batches;
- `rstar2 eval` greedy (`eval.temperature=0`) answers every problem as the HF engine does.
"""

from __future__ import annotations

import json

import pytest

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.errors import StaleEngineWeights
from rstar2_core.rl.stage import run_rl_stage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

OVERRIDES = ["rl.prompts_per_step=3", "rl.grpo.group_size=4", "rl.grpo.oversample=2",
             "rl.stages.0.max_response_tokens=200", "rl.stages.0.max_turns=3", "rl.lr=1e-3", "rl.warmup_steps=2",
             "rl.micro_batch_size=8", "rl.checkpoint_every=1", "rollout.max_batch_size=24", "sandbox.workers=2",
             "rl.temperature=0.6", "rollout.tool_response_timing=false", 'rollout.engine="vllm"']
RAY = ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"',
       "cluster.trainer_ranks=2", "rollout.num_engines=1"]


def _gaps_at_float32_noise(stream):
    stepped = [m for _, m in stream if not m["actor/skipped"]]
    for m in stepped:
        assert m["actor/engine_logprob_gap"] < 1e-4, m["actor/engine_logprob_gap"]
        assert m["actor/engine_logprob_gap_max"] < 1e-2, m["actor/engine_logprob_gap_max"]
    return stepped


def test_rl_stage_on_vllm_stops_on_stale_weights_and_the_retry_finishes(toy_policy, tmp_path, monkeypatch):
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.0.steps=3"])
    out = (tmp_path / "rl").as_uri()
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=2:stale-weights")
    first: list = []
    with pytest.raises(StaleEngineWeights, match="rl.max_engine_logprob_gap"):
        run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                     log_metrics=lambda m, s: first.append((s, dict(m))))
    # the fault fired at step 2; the first step after it that took an update measured the gap and stopped
    assert first and first[0][0] == 1 and all(m["actor/skipped"] for _, m in first[1:])
    _gaps_at_float32_noise(first)
    retry: list = []
    res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                       log_metrics=lambda m, s: retry.append((s, dict(m))))
    assert [s for s, _ in first + retry][-1] == 3 and storage.is_complete(res.checkpoint_url)
    stepped = _gaps_at_float32_noise(first + retry)
    assert stepped, "no step took an update: the toy policy's groups had no signal"
    assert all(m["sync/bytes"] > 0 for m in stepped)                  # each update reached the engine


def test_rl_stage_on_vllm_engine_actors_on_the_ray_runtime(toy_policy, local_ray, tmp_path):
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + RAY + ["rl.stages.0.steps=3"])
    stream: list = []
    res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "ray").as_uri(),
                       log_metrics=lambda m, s: stream.append((s, dict(m))))
    assert [s for s, _ in stream] == [1, 2, 3] and storage.is_complete(res.checkpoint_url)
    stepped = _gaps_at_float32_noise(stream)
    assert stepped and all(m["sync/bytes"] > 0 for m in stepped)          # object store: one state dict
    assert stream[-1][1]["runtime/trainer_ranks"] == 2 and stream[-1][1]["runtime/engines"] == 1


def test_async_rl_stage_on_vllm_pushes_weights_between_batches(toy_policy, tmp_path):
    """`rl.max_staleness = 1` with the vLLM engine: batch 2 is sampled while step 1 updates; a batch
    sampled by the trainer's own weights (staleness 0) keeps the gap at float32 noise, so the pushes
    between batches land whole."""
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.0.steps=3", "rl.max_staleness=1", "rl.tis_cap=2.0"])
    stream: list = []
    res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "async").as_uri(),
                       log_metrics=lambda m, s: stream.append((s, dict(m))))
    assert [s for s, _ in stream] == [1, 2, 3] and storage.is_complete(res.checkpoint_url)
    assert [m["rollout/staleness"] for _, m in stream][:2] == [0.0, 1.0]
    _gaps_at_float32_noise([(s, m) for s, m in stream if m["rollout/staleness"] == 0])
    assert any(m.get("sync/bytes", 0) > 0 for _, m in stream)


def test_eval_greedy_on_vllm_answers_as_the_hf_engine(toy_policy, tmp_path, capsys):
    from toy_policy import write_toy_problems

    from rstar2_cli.main import main

    ckpt, _, _ = toy_policy
    bench = write_toy_problems((tmp_path / "toy_eval.jsonl").as_uri(), range(200, 208))
    samples = {}
    for engine in ("hf", "vllm"):
        out = (tmp_path / engine).as_uri()
        rc = main(["eval", "--profile", "tiny", "--model", ckpt, "--bench", bench, "--layout", "generic", "--k", "2",
                   "--out", out, "--set", f'rollout.engine="{engine}"', "--set", "eval.temperature=0",
                   "--set", "eval.max_tokens=200", "--set", "eval.max_turns=3", "--set", "sandbox.workers=2",
                   "--set", "rollout.tool_response_timing=false"])
        assert rc == 0, capsys.readouterr().err
        rows = storage.read_text(storage.join(out, "samples", "toy_eval.jsonl")).splitlines()
        samples[engine] = {(r["id"], r["sample"]): r for r in map(json.loads, rows)}
    assert len(samples["hf"]) == len(samples["vllm"]) == 16
    for key, h in samples["hf"].items():
        v = samples["vllm"][key]
        assert (v["response_text"], v["reward"], v["extracted"]) == (h["response_text"], h["reward"], h["extracted"])
    assert any(h["tool_calls"] for h in samples["hf"].values())      # the answers went through the tool
