"""Step batch: zero-variance groups dropped, infra-failed trajectories excluded, RoC vs plain GRPO."""

import pytest

from rstar2_core import storage
from rstar2_core.config import GRPOConfig
from rstar2_core.rl.data import batch_indices, load_problems
from rstar2_core.rl.groups import build_step_batch
from rstar2_core.rollout.types import ToolCallRecord, Trajectory


def T(name, calls=(), infra=None, infra_call=False, answers=1, turns=1, truncated=False):
    recs = tuple(ToolCallRecord(name="python", status="error" if f else "ok", failed=f) for f in calls)
    if infra_call:
        recs += (ToolCallRecord(name="python", status="internal", failed=False, infra=True),)
    return Trajectory(prompt_ids=(1,), response_ids=(2, 3), loss_mask=(1, 1), logprobs=(0.0, 0.0),
                      response_text=name, tool_calls=recs, n_turns=turns, n_answer_blocks=answers,
                      finish="answer", truncated=truncated, infra_error=infra)


def cfg(**kw):
    return GRPOConfig(group_size=2, oversample=2, **kw)


def test_zero_variance_groups_are_dropped_and_counted():
    groups = [[T("a"), T("b"), T("c"), T("d")], [T("e"), T("f"), T("g"), T("h")], [T("i"), T("j"), T("k"), T("l")]]
    rewards = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]]
    sb = build_step_batch(groups, rewards, cfg(), seed=0)
    assert sb.metrics["rollout/groups_dropped_all_correct"] == 1
    assert sb.metrics["rollout/groups_dropped_all_wrong"] == 1
    assert sb.metrics["rollout/groups_kept"] == 1
    assert {t.response_text for t in sb.trajectories} <= {"i", "j", "k", "l"}
    assert len(sb.trajectories) == 2 and sorted(sb.advantages) == pytest.approx([-1.0, 1.0], abs=1e-4)
    assert sb.metrics["rollout/pass_rate"] == pytest.approx(6 / 12)
    assert sb.metrics["rollout/solve_rate"] == pytest.approx(2 / 3)


def test_infra_failed_trajectories_are_excluded_from_statistics():
    # without exclusion the group {1, 0(infra), 0(infra), 1} would have variance; with it, it is all-correct
    groups = [[T("a"), T("b", infra="engine crashed"), T("c", infra_call=True), T("d")]]
    sb = build_step_batch(groups, [[1, 0, 0, 1]], cfg(), seed=0)
    assert sb.metrics["rollout/infra_failed"] == 2
    assert sb.metrics["rollout/groups_dropped_all_correct"] == 1 and not sb.trajectories
    assert sb.metrics["rollout/pass_rate"] == 1.0
    # an infra failure never becomes a kept negative
    groups = [[T("a"), T("b", infra="x"), T("c"), T("d"), T("e")]]
    sb = build_step_batch(groups, [[1, 0, 0, 1, 0]], GRPOConfig(group_size=4, oversample=2), seed=3)
    assert "b" not in {t.response_text for t in sb.trajectories} and len(sb.trajectories) == 4


def test_group_with_one_valid_member_is_dropped():
    sb = build_step_batch([[T("a"), T("b", infra="x")]], [[1, 0]], cfg(), seed=0)
    assert sb.metrics["rollout/groups_dropped_too_few"] == 1 and not sb.trajectories


def test_roc_keeps_clean_positives_and_plain_grpo_keeps_all():
    clean = [T(f"clean{i}", calls=(False,)) for i in range(2)]
    sloppy = [T(f"sloppy{i}", calls=(True, True, False)) for i in range(2)]
    negs = [T(f"neg{i}", calls=(True,), answers=0) for i in range(4)]
    group = sloppy + clean + negs
    rewards = [1, 1, 1, 1, 0, 0, 0, 0]
    roc = build_step_batch([group], [rewards], GRPOConfig(group_size=4, oversample=2,
                                                            positive_mode="lowest_penalty"), seed=0)
    kept = {t.response_text for t in roc.trajectories}
    assert {"clean0", "clean1"} <= kept and not kept & {"sloppy0", "sloppy1"}
    assert roc.metrics["rollout/kept_pos_tool_error_ratio"] == 0.0
    assert roc.metrics["rollout/pos_tool_error_ratio"] == pytest.approx(4 / 8)
    assert roc.metrics["rollout/neg_tool_error_ratio"] == 1.0
    plain = build_step_batch([group], [rewards], GRPOConfig(group_size=8, oversample=1, resample="none"), seed=0)
    assert len(plain.trajectories) == 8
    assert plain.metrics["rollout/kept_pos_tool_error_ratio"] == pytest.approx(4 / 8)
    assert plain.advantages == pytest.approx([1.0] * 4 + [-1.0] * 4, abs=1e-4)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="same shape"):
        build_step_batch([[T("a")]], [[1, 0]], cfg(), seed=0)


def test_batch_indices_deterministic_epochs_without_replacement():
    a = batch_indices(10, seed=3, cursor=0, size=25)
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:20]) == list(range(10))
    assert a[:10] != a[10:20]
    assert batch_indices(10, 3, 7, 6) == a[7:13]   # the same stream from any cursor
    assert batch_indices(10, 4, 0, 10) != a[:10]


def test_load_problems_rejects_malformed_rows_with_reasons(tmp_path):
    url = (tmp_path / "rl.jsonl").as_uri()
    storage.write_text_atomic(url, '{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "b", "problem": "", "answer": "2"}\n{"id": "c", "problem": "x", "answer": null}\nnot json\n{"id": "a", "problem": "dup", "answer": "3"}\n{"id": "d", "problem": "2+2?", "answer": 4}')
    problems, rejected = load_problems(url)
    assert [(p.id, p.answer) for p in problems] == [("a", "2"), ("d", "4")]
    assert rejected == {"missing_problem": 1, "missing_answer": 1, "invalid_json": 1, "duplicate_id": 1}
    storage.write_text_atomic(url, '{"id": "b", "problem": ""}')
    with pytest.raises(ValueError, match="no usable"):
        load_problems(url)


def test_the_step_counts_every_kind_of_infrastructure_failure_once():
    from dataclasses import dataclass

    from rstar2_core.rl.step import grade_groups, infra_failures

    @dataclass
    class G:
        reward: float
        extracted: str | None
        reason: str

    class Grader:                      # one answer per reason the pool gives
        def grade_many(self, items):
            return [G(1.0, "4", "correct"), G(0.0, None, "grader_timeout"), G(0.0, None, "grader_error"),
                    G(0.0, "5", "wrong"), G(0.0, None, "grader_error"), G(0.0, "5", "wrong")][:len(items)]

    groups = [[T("a"), T("b"), T("c")], [T("d", infra="engine: request failed"), T("e", infra_call=True), T("f")]]
    grades = grade_groups(Grader(), groups, ["4", "4"])
    assert grades.grader_failed == [[None, "grader_timeout", "grader_error"], [None, "grader_error", None]]
    m = infra_failures(groups, grades)
    # trajectory e is both sandbox-failed and grader-failed: it counts once, as the sandbox's
    assert (m["infra/engine_errors"], m["infra/sandbox_errors"], m["infra/grader_timeouts"],
            m["infra/grader_errors"]) == (1, 1, 1, 1)
    assert m["infra/failed_share"] == pytest.approx(4 / 6)
