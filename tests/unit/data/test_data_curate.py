import re

import pytest
from data_fixtures import FIX, fixture_config

from rstar2_core import storage
from rstar2_core.data.curate import curate, read_dataset
from rstar2_core.rollout.types import Trajectory

EXPECTED_IDS = ["dapo/dapo-0000", "dapo/dapo-0001", "dapo/dapo-0002", "omr/0", "omr/4", "pe/1", "pe/3", "generic/g1",
                "generic/g3"]


def test_curate_fixture_sources_counts_and_output(cfg, tmp_path):
    metrics = []
    ref = curate(cfg, f"file://{tmp_path}/ds", log_metrics=lambda m, s: metrics.append((m, s)), progress=False)
    rows = read_dataset(ref.url)
    assert [r["id"] for r in rows] == EXPECTED_IDS
    assert {r["id"]: r["answer"] for r in rows}["dapo/dapo-0001"] == "1000"
    assert {r["id"]: r["answer"] for r in rows}["dapo/dapo-0002"] == "2"
    assert {r["id"]: r["answer"] for r in rows}["omr/0"] == "12"
    assert {r["id"]: r["answer"] for r in rows}["omr/4"] == "-7"
    assert set(rows[0]) == {"id", "problem", "answer", "source"}
    c = ref.counts
    assert c["read"] == {"dapo": 7, "omr": 5, "pe": 3, "generic": 3}
    assert c["malformed"] == {"missing_field:reward_model": 1, "problem_type:converted_proof": 1}
    assert c["answer"] == {"answer_not_integer": 2, "answer_too_many_digits": 1}
    assert c["exact_dedup"] == {"duplicate_exact": 2}
    assert c["near_dedup"] == {"duplicate_near": 1}
    assert c["decontamination"] == {"contaminated:aime24": 1}
    assert c["kept"] == ref.n_rows == len(EXPECTED_IDS)
    manifest = storage.read_json(ref.manifest_url)
    assert manifest["digest"] == ref.digest and ref.url.endswith(f"{ref.digest[:16]}/problems.parquet")
    import hashlib
    src = {s["name"]: s["sha256"] for s in manifest["sources"]}
    assert src["dapo"] == hashlib.sha256((FIX / "dapo_math.jsonl").read_bytes()).hexdigest()
    assert manifest["config"]["data"]["near_dup_threshold"] == 0.5
    assert set(manifest["benchmarks"]) == {"aime24", "math500"}
    assert metrics and metrics[0][0]["data/kept"] == len(EXPECTED_IDS)
    assert metrics[0][0]["data/dropped/decontamination"] == 1.0


def test_version_is_the_content_digest(cfg, tmp_path):
    a = curate(cfg, str(tmp_path / "a"), progress=False)
    b = curate(cfg, str(tmp_path / "b"), progress=False)
    assert a.digest == b.digest and read_dataset(a.url) == read_dataset(b.url)
    c = curate(fixture_config(max_answer_digits=3), str(tmp_path / "c"), progress=False)
    assert c.digest != a.digest and c.counts["answer"]["answer_too_many_digits"] == 3  # + 1000, 45486


def test_missing_benchmark_fails_before_reading_sources(tmp_path):
    cfg = fixture_config()
    cfg.eval.benchmarks[0].url = str(tmp_path / "absent.jsonl")
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        curate(cfg, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_empty_result_is_an_error(tmp_path):
    cfg = fixture_config(max_answer_digits=1)
    cfg.data.sources = cfg.data.sources[2:3]
    with pytest.raises(ValueError, match="kept 0 problems"):
        curate(cfg, str(tmp_path / "out"), progress=False)


class KnownLabelSampler:
    """Answers a problem correctly on the first `n_right[problem]` of its k samples, wrongly after."""

    def __init__(self, n_right):
        self.n_right = n_right
        self.calls = []

    def sample(self, problems, n, limits, seed):
        self.calls.append((list(problems), n, seed))
        out = []
        for p in problems:
            good, ans = self.n_right[p]
            out.append([_traj(f"<answer>\\boxed{{{ans if j < good else 'wrong'}}}</answer>") for j in range(n)])
        return out

    def close(self):
        pass


def _traj(text):
    return Trajectory(prompt_ids=(1,), response_ids=(2, 3), loss_mask=(1, 1), logprobs=(0.0, 0.0), response_text=text,
                      tool_calls=(), n_turns=1, n_answer_blocks=1, finish="answer", truncated=False)


class Graded:
    def __init__(self, ok):
        self.reward = 1.0 if ok else 0.0
        self.extracted = None
        self.reason = "correct" if ok else "wrong"


def exact_grader(items):
    return [Graded(re.search(r"\\boxed\{(.*?)\}", t).group(1) == gold) for t, gold in items]


def test_label_check_keeps_problems_with_enough_agreement(tmp_path):
    from rstar2_core.data.curate import read_all_sources
    from rstar2_core.data.label_check import label_check

    cfg = fixture_config()
    cands = [c for r in read_all_sources(cfg) for c in r.candidates if r.name == "pe"]
    # pe/1: 3 of 4 agree; pe/2: 1 of 4; pe/3: 2 of 4
    right = {cands[0].problem: (3, cands[0].answer), cands[1].problem: (1, cands[1].answer),
             cands[2].problem: (2, cands[2].answer)}
    sampler = KnownLabelSampler(right)
    kept, dropped, agree = label_check(cands, sampler, exact_grader, k=4, min_agree=2, limits=None, seed=5,
                                       batch_size=2, progress=False)
    assert [c.id for c in kept] == ["pe/1", "pe/3"] and dropped == {"label_disagree": 1}
    assert agree == {"pe/1": 3, "pe/2": 1, "pe/3": 2}
    assert [len(c[0]) for c in sampler.calls] == [2, 1] and all(c[1] == 4 for c in sampler.calls)
    with pytest.raises(ValueError, match="min_agree"):
        label_check(cands, sampler, exact_grader, k=2, min_agree=3, limits=None, seed=0)


def test_label_check_without_a_sampler_or_a_model_fails_before_work(tmp_path):
    from rstar2_core.eval.sampler import label_check_sampler

    cfg = fixture_config(label_check={"enabled": True})
    with pytest.raises(ValueError, match="needs a sampler of the checking model"):
        curate(cfg, str(tmp_path / "out"), progress=False)  # curation never loads a model itself
    with pytest.raises(ValueError, match="data.label_check.model"), label_check_sampler(cfg):
        pass
    assert not (tmp_path / "out").exists()
    with label_check_sampler(fixture_config()) as off:
        assert off is None


class LimitsSampler(KnownLabelSampler):
    """Every problem right on every sample; records the limits it was asked to sample with."""

    def __init__(self, answers):
        super().__init__({p: (99, a) for p, a in answers.items()})
        self.limits = []

    def sample(self, problems, n, limits, seed):
        self.limits.append(limits)
        return super().sample(problems, n, limits, seed)


def test_the_label_check_runs_within_its_budget(tmp_path):
    """`data.label_check` max_problems / max_response_tokens / max_turns: a seeded sample of that many
    candidates is checked (the rest dropped as `label_unchecked`), each sample within the budget's limits
    instead of the evaluation's (30K tokens, 30 turns in production)."""
    from rstar2_core.data.curate import read_all_sources
    from rstar2_core.data.label_check import label_check

    cfg = fixture_config()
    cands = [c for r in read_all_sources(cfg) for c in r.candidates]
    sampler = KnownLabelSampler({c.problem: (2, c.answer) for c in cands})
    kept, dropped, _ = label_check(cands, sampler, exact_grader, k=2, min_agree=1, limits=None, seed=3,
                                   batch_size=64, progress=False, max_problems=3)
    assert len(kept) == 3 and dropped == {"label_unchecked": len(cands) - 3}
    assert [len(c[0]) for c in sampler.calls] == [3]
    again = KnownLabelSampler(sampler.n_right)
    kept2, _, _ = label_check(cands, again, exact_grader, k=2, min_agree=1, limits=None, seed=3, progress=False,
                              max_problems=3)
    assert [c.id for c in kept2] == [c.id for c in kept]        # the same seeded sample
    budget = {"enabled": True, "k": 2, "min_agree": 1, "max_problems": 2, "max_response_tokens": 300, "max_turns": 4}
    spy = LimitsSampler({c.problem: c.answer for c in cands})
    ref = curate(fixture_config(label_check=budget), (tmp_path / "out").as_uri(), sampler=spy, progress=False)
    assert {(lim.max_response_tokens, lim.max_turns) for lim in spy.limits} == {(300, 4)}
    assert ref.n_rows == 2 and ref.counts["label_check"]["label_unchecked"] > 0


def test_a_label_check_on_the_ray_runtime_holds_the_runtime_slot():
    """Curation samples the checking model on the whole-cluster runtime: like an RL stage it takes the
    cluster's one runtime slot, so it never competes with SFT for the GPUs (and `rstar2 plan` shows it)."""
    from rstar2_cli.plan import recipe_dag
    from rstar2_core.config import load_config
    from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE
    from tasks.runners import resources

    prod = load_config("qwen3-14b-mi300x")
    assert resources(prod, "curate")["resources"] == {RUNTIME_RESOURCE: 1}
    assert next(t for t in recipe_dag(prod) if t.kind == "curate").runtime_slot
    off = load_config("qwen3-14b-mi300x", ["data.label_check.enabled=false"])
    assert "resources" not in resources(off, "curate")
