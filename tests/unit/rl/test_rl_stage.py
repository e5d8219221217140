"""The RL stage loop end to end on the toy policy (real engine, sandbox, grader): metrics, checkpoints,
and exact resume after a crash."""

import json

import pytest
import torch
from rollout_trace import recording
from stage_compare import assert_same_steps

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.models.io import load_model_and_tokenizer, read_meta
from rstar2_core.rl.checkpoint import read_rl_state
from rstar2_core.rl.stage import run_rl_stage
from rstar2_core.runtime.checkpoint import read_rank_state

pytestmark = pytest.mark.slow

OVERRIDES = ["rl.prompts_per_step=3", "rl.grpo.group_size=4", "rl.grpo.oversample=2", "rl.stages.0.steps=4",
             "rl.stages.0.max_response_tokens=200", "rl.stages.0.max_turns=3", "rl.lr=1e-3", "rl.warmup_steps=2",
             "rl.micro_batch_size=8", "rl.checkpoint_every=1", "rl.keep_checkpoints=2", "rollout.max_batch_size=24",
             "sandbox.workers=2", "rl.temperature=0.6", "rollout.tool_response_timing=false", "sandbox.timeout_s=30"]
# The toy policy writes a parseable tool call ~5% of the time at temperature 1.0 and ~half the time at 0.6:
# these tests need the sandbox to run calls, not the paper's exploration temperature. Tool responses
# without the (wall-clock) execution time, and a tool timeout no call reaches on a loaded machine (the toy's
# calls print a number; the traces assert that none timed out), so that a resumed stage can repeat the
# straight run bit for bit.


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only add contention at these sizes
    yield
    torch.set_num_threads(n)


WALL_CLOCK = ("timing/", "sync/seconds", "sync/engine_max_s", "usage/engine_", "usage/trainer_", "usage/sandbox_call_s",
              "usage/sandbox_p", "usage/sandbox_cpu_s", "total/sync/seconds", "total/usage/engine_",
              "total/usage/trainer_", "total/usage/sandbox_call_s", "total/usage/sandbox_cpu_s")


def _exact(stream):
    """Metrics that must repeat bit for bit. Timings and busy/idle seconds are wall-clock;
    `actor/engine_logprob_gap` (and its stage maximum `total/actor/engine_logprob_gap_max`) compares the
    engine's log-probs, whose last bits depend on which requests shared a decode batch, with the trainer's."""
    return [(s, {k: v for k, v in m.items() if not k.startswith(WALL_CLOCK) and "engine_logprob_gap" not in k})
            for s, m in stream]


def _weights(url):
    model, _ = load_model_and_tokenizer(url)
    return model.state_dict()


def test_resume_after_crash_matches_straight_run(toy_policy, tmp_path, monkeypatch, one_thread):
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES)
    straight: list = []
    trace_a: list = []
    trace_b: list = []
    with recording(trace_a, cfg.rl.seed):
        res_a = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "a").as_uri(),
                             log_metrics=lambda m, s: straight.append((s, dict(m))), tracking_run_id="run-a")
    # same stage, killed when step 3 begins (after step 2's checkpoint), then resumed
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=3")
    out_b = (tmp_path / "b").as_uri()
    crashed: list = []
    from rstar2_core.faults import InjectedFault

    with recording(trace_b, cfg.rl.seed), pytest.raises(InjectedFault):
        run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out_b,
                     log_metrics=lambda m, s: crashed.append((s, dict(m))), tracking_run_id="run-b")
    assert [s for s, _ in crashed] == [1, 2]
    assert not storage.is_complete(storage.join(out_b, "final"))
    resumed: list = []
    with recording(trace_b, cfg.rl.seed):
        res_b = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out_b,
                             log_metrics=lambda m, s: resumed.append((s, dict(m))))
    assert [s for s, _ in resumed] == [3, 4]
    near_tie = assert_same_steps(straight, crashed + resumed, trace_a, trace_b)
    upto = len(straight) if near_tie is None else near_tie.step - 1     # the HF engine's batches differ on resume
    assert _exact(crashed + resumed)[:upto] == _exact(straight)[:upto]
    for (_, a), (_, b) in list(zip(crashed + resumed, straight))[:upto]:
        assert a.get("actor/engine_logprob_gap", 0) == pytest.approx(b.get("actor/engine_logprob_gap", 0), abs=1e-5)
    wa, wb = _weights(res_a.checkpoint_url), _weights(res_b.checkpoint_url)
    if near_tie is None:
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the run id stored at step 1 survives the crash; optimizer state and cursor are in the checkpoint
    assert res_b.extra["tracking_run_id"] == "run-b" and res_a.extra["tracking_run_id"] == "run-a"
    state = read_rl_state(res_b.checkpoint_url)
    assert state["cursor"] == 4 * 3 and read_rank_state(res_b.checkpoint_url, 0, 1)["step"] == sum(
        1 for _, m in crashed + resumed if not m["actor/skipped"])
    # the policy moved and the stage did real work
    w0 = _weights(ckpt)
    assert any(not torch.equal(w0[k], wa[k]) for k in wa)
    assert any(m["rollout/groups_kept"] > 0 for _, m in straight)
    # where the time went: the sandbox's calls and their CPU, tokens generated vs trained, summed over the stage
    with_calls = [m for _, m in straight if m["usage/sandbox_calls"] > 0]
    assert with_calls and all(0 < m["usage/sandbox_cpu_s"] <= m["usage/sandbox_call_s"] for m in with_calls)
    last = straight[-1][1]
    assert last["total/usage/tokens_generated"] == sum(m["usage/tokens_generated"] for _, m in straight)
    assert last["total/usage/tokens_trained"] <= last["total/usage/tokens_generated"]
    assert last["runtime/engines"] == 1 and last["runtime/trainer_ranks"] == 1
    assert all(m["rollout/trajectories"] == 3 * 8 for _, m in straight)
    # only the last 2 step checkpoints are kept; a rerun of a finished stage returns at once
    steps = [u.rsplit("/", 1)[-1] for u in storage.list_dirs(storage.join(out_b, "steps"))]
    assert steps == ["step-000003", "step-000004"]
    for name in ("model.safetensors", "trainer/rank-00000.pt"):   # the final is step 4's files, not a new write
        assert (tmp_path / "b/final" / name).stat().st_ino == (tmp_path / "b/steps/step-000004" / name).stat().st_ino
    again = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out_b)
    assert again.checkpoint_url == res_b.checkpoint_url and again.extra["resumed"]
    assert read_meta(res_b.checkpoint_url)["steps"] == 4
    json.dumps(res_b.to_json())


def test_hard_subset_drops_problems_solved_k_of_k(toy_policy, tmp_path, one_thread):
    from rstar2_core.rl.data import load_problems
    from rstar2_core.rl.hard_subset import select_hard_subset

    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.2.hard_subset_k=2", "rl.stages.2.max_response_tokens=200"])
    out = (tmp_path / "hard").as_uri()
    ref = select_hard_subset(cfg, 2, checkpoint_url=ckpt, data_url=data, out_url=out)
    c = ref.counts
    assert c["input"] == 12 and c["k"] == 2 and c["kept"] + c["solved_all"] == 12 and c["kept"] == ref.n_rows
    assert c["infra_failed"] == 0
    kept, rejected = load_problems(ref.url)
    assert len(kept) == ref.n_rows and not rejected
    assert {p.id for p in kept} <= {f"t{i}" for i in range(100, 112)}
    # same inputs -> the published subset is returned as is (no new sampling, same digest)
    again = select_hard_subset(cfg, 2, checkpoint_url=ckpt, data_url=data, out_url=out)
    assert again == ref


def test_an_outage_during_the_hard_subset_is_a_retryable_error_not_the_whole_pool(toy_policy, tmp_path, one_thread,
                                                                                 monkeypatch):
    from rstar2_core import reward
    from rstar2_core.errors import InfraFailureShareExceeded
    from rstar2_core.reward.grade import GradeResult
    from rstar2_core.rl.hard_subset import select_hard_subset

    class DeadGrader(reward.GraderPool):      # every worker dies mid-item: nothing can be judged
        def grade_many(self, items):
            return [GradeResult(0.0, None, "grader_error") for _ in items]

    monkeypatch.setattr(reward, "GraderPool", DeadGrader)
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.2.hard_subset_k=2", "rl.stages.2.max_response_tokens=200"])
    out = (tmp_path / "hard").as_uri()
    with pytest.raises(InfraFailureShareExceeded, match="grader errors"):
        select_hard_subset(cfg, 2, checkpoint_url=ckpt, data_url=data, out_url=out)
    assert not storage.exists(storage.join(out, "manifest.json"))       # nothing was published


def test_next_stage_continues_the_optimizer_and_lr_schedule(toy_policy, tmp_path, one_thread):
    ckpt, data, _ = toy_policy
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.0.steps=2", "rl.stages.1.steps=1", "rl.warmup_steps=4"])
    s1: list = []
    r1 = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / "s1").as_uri(),
                      log_metrics=lambda m, s: s1.append((s, m)))
    s2: list = []
    r2 = run_rl_stage(cfg, 1, init_checkpoint_url=r1.checkpoint_url, data_url=data,
                      out_url=(tmp_path / "s2").as_uri(), log_metrics=lambda m, s: s2.append((s, m)))
    assert [s for s, _ in s1] == [1, 2] and [s for s, _ in s2] == [3]   # global steps continue
    taken = sum(1 for _, m in s1 if not m["actor/skipped"])
    st1, st2 = read_rl_state(r1.checkpoint_url), read_rl_state(r2.checkpoint_url)
    assert taken >= 1 and not s2[0][1]["actor/skipped"]   # seeded: these rollouts do have signal
    assert read_rank_state(r2.checkpoint_url, 0, 1)["step"] == taken + 1
    # warm-up position carried over: stage 2's first update is optimizer step `taken` (0-based) of 4 warm-up
    # steps; a fresh schedule would give 1e-3 / 4
    assert s2[0][1]["actor/lr"] == pytest.approx(1e-3 * (taken + 1) / 4)
    assert st2["cursor"] == 3 and st1["cursor"] == 6   # each stage has its own data cursor


class _Stream(list):
    def append_step(self, metrics: dict, step: int) -> None:
        self.append((step, dict(metrics)))


def test_checkpoint_weight_sync_takes_the_same_steps_as_the_in_process_sync(toy_policy, tmp_path, one_thread):
    """rollout.weight_sync = "checkpoint": the engine reloads each step's published checkpoint instead of
    copying the trainer's tensors, and the stage takes the same steps: bit for bit up to a near-tie in
    sampling (the HF engine's logits change in their last bits with the requests that share a decode batch,
    which the load decides), what the design keeps exact throughout, the same final weights without one."""
    ckpt, data, _ = toy_policy
    base = OVERRIDES + ["rl.stages.0.steps=3"]
    runs, traces, finals = {}, {}, {}
    for mode in ("state_dict", "checkpoint"):
        stream, trace = _Stream(), []
        cfg = load_config("tiny", base + [f'rollout.weight_sync="{mode}"'])
        with recording(trace, cfg.rl.seed):
            res = run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=(tmp_path / mode).as_uri(),
                               log_metrics=stream.append_step)
        runs[mode], traces[mode], finals[mode] = stream, trace, res.checkpoint_url

    def same(stream):
        return [(s, {k: v for k, v in m.items() if not k.endswith("sync/bytes")}) for s, m in _exact(stream)]

    near_tie = assert_same_steps(runs["state_dict"], runs["checkpoint"], traces["state_dict"], traces["checkpoint"])
    upto = len(runs["state_dict"]) if near_tie is None else near_tie.step - 1
    assert same(runs["checkpoint"])[:upto] == same(runs["state_dict"])[:upto]
    def updates(stream):
        return [{k: v for k, v in m.items() if k.startswith("actor/")} for _, m in same(stream)]

    # a near-tie in a trajectory no update kept leaves every update, so every weight, the same
    if near_tie is None or updates(runs["checkpoint"]) == updates(runs["state_dict"]):
        wa, wb = _weights(finals["state_dict"]), _weights(finals["checkpoint"])
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    synced = [m for _, m in runs["checkpoint"] if "sync/bytes" in m]
    assert synced and all(m["sync/bytes"] == 0 for m in synced)                  # nothing copied in memory
    assert all(m["sync/bytes"] > 0 for _, m in runs["state_dict"] if "sync/bytes" in m)


def test_a_stage_that_never_updates_the_policy_fails_and_writes_no_final(toy_policy, tmp_path, one_thread):
    """Every gold answer is one the policy never writes: every group is all wrong, no step updates the
    policy, and the stage refuses to pass the unchanged policy on as trained (also when resumed)."""
    from rstar2_core.errors import StageTrainedNothing

    ckpt, _, _ = toy_policy
    data = (tmp_path / "unsolvable.jsonl").as_uri()
    rows = [json.loads(line) for line in storage.read_text(toy_policy[1]).splitlines()]
    storage.write_text_atomic(data, "\n".join(json.dumps({**r, "answer": "987654321"}) for r in rows))
    cfg = load_config("tiny", OVERRIDES + ["rl.stages.0.steps=2"])
    out = (tmp_path / "nothing").as_uri()
    seen: list = []
    with pytest.raises(StageTrainedNothing, match=r"ran its 2 steps without one optimizer step: of its groups 6 "
                                                  r"had every rollout wrong"):
        run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out,
                     log_metrics=lambda m, s: seen.append(m))
    assert [m["actor/skipped"] for m in seen] == [1.0, 1.0] and seen[-1]["total/actor/skipped"] == 2.0
    assert not storage.is_complete(storage.join(out, "final"))
    with pytest.raises(StageTrainedNothing):      # the resume finds the same totals in the last step checkpoint
        run_rl_stage(cfg, 0, init_checkpoint_url=ckpt, data_url=data, out_url=out)
