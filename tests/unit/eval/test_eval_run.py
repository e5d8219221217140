import json
from pathlib import Path

import pytest
from eval_fakes import ScriptedSampler, exact_grader

from rstar2_core import storage
from rstar2_core.config import load_config
from rstar2_core.data.benchmarks import benchmark_from_url, load_benchmark
from rstar2_core.eval.metrics import EvalReport
from rstar2_core.eval.report import diff_markdown, plot_history
from rstar2_core.eval.run import evaluate

FIX = Path(__file__).resolve().parents[2] / "fixtures"
PNG = b"\x89PNG\r\n\x1a\n"


def synthetic_cfg(n=120, *extra):
    return load_config("tiny", [f"data.synthetic.n_eval={n}", f"eval.benchmarks.0.limit={n}", *extra])


def run(cfg, tmp_path, p, name="out", k=8, **kw):
    bench = load_benchmark(cfg.eval.benchmarks[0], cfg)
    sampler = ScriptedSampler({q.problem: q.answer for q in bench.problems}, p)
    rep = evaluate(cfg, checkpoint_url=f"ckpt-p{p}", out_url=str(tmp_path / name), k=k, sampler=sampler,
                   grade_math=exact_grader, progress=False, **kw)
    return rep, sampler


@pytest.mark.parametrize("p", [0.0, 0.3, 0.8, 1.0])
def test_avg_at_k_recovers_a_known_accuracy(tmp_path, p):
    cfg = synthetic_cfg()
    rep, _ = run(cfg, tmp_path, p)
    m = rep.metrics["synthetic"]
    assert m.n_problems == 120 and m.k == 8
    assert m.pass1 == pytest.approx(p, abs=0.05)       # 960 Bernoulli(p) samples: sd <= 0.016
    if p in (0.0, 1.0):
        assert m.pass1 == p and m.pass_k == p
    else:
        assert m.pass_k > m.pass1
    assert m.tool_calls_per_traj == 2.0 and m.tool_error_ratio == 0.5
    assert m.truncation_rate == pytest.approx(1 / 8)
    assert m.mean_response_tokens == pytest.approx(10 + 3.5)


def test_same_seed_same_table_other_seed_differs(tmp_path):
    cfg = synthetic_cfg(40)
    a, sa = run(cfg, tmp_path, 0.5, "a", k=4)
    b, _ = run(cfg, tmp_path, 0.5, "b", k=4)
    assert a.rows == b.rows and a.metrics == b.metrics
    assert sa.seeds == [cfg.eval.seed, cfg.eval.seed + 32]   # one call per chunk of 32 problems
    c, _ = run(synthetic_cfg(40, "eval.seed=99"), tmp_path, 0.5, "c", k=4)
    assert c.rows != a.rows


def test_report_files_and_reload(tmp_path):
    cfg = synthetic_cfg(20)
    logged = []
    rep, _ = run(cfg, tmp_path, 0.5, k=4, log_metrics=lambda m, s: logged.append((m, s)), step=7)
    out = tmp_path / "out"
    md = (out / "report.md").read_text()
    assert "| synthetic | 20 | 4 |" in md and "## synthetic: per problem" in md
    assert md.count("\n| syn-eval-") == 20
    assert (out / "summary.png").read_bytes().startswith(PNG)
    samples = [json.loads(x) for x in (out / "samples" / "synthetic.jsonl").read_text().splitlines()]
    assert len(samples) == 80 and {"reward", "response_text", "extracted"} <= set(samples[0])
    again = EvalReport.load(str(out))
    assert again.metrics == rep.metrics and again.rows == rep.rows and again.report_url == rep.report_url
    assert logged == [(rep.metrics["synthetic"].as_metrics(), 7)]
    assert rep.protocol["k"] == 4 and rep.protocol["temperature"] == 0.6 and rep.protocol["max_turns"] == 4


def test_compare_reports_per_problem_diff(tmp_path):
    cfg = synthetic_cfg(30)
    a, _ = run(cfg, tmp_path, 0.2, "a", k=4)
    b, _ = run(cfg, tmp_path, 0.9, "b", k=4)
    md = diff_markdown(a, b, ("sft", "rl"))
    ra = {r.id: r for r in a.rows["synthetic"]}
    rb = {r.id: r for r in b.rows["synthetic"]}
    changed = [i for i in ra if ra[i].n_correct != rb[i].n_correct]
    assert f"{len(changed)} of 30 problems changed" in md
    for i in changed:
        assert f"| {i} | {ra[i].n_correct}/4 | {rb[i].n_correct}/4 |" in md
    delta = b.metrics["synthetic"].pass1 - a.metrics["synthetic"].pass1
    assert f"| synthetic | pass@1 (avg@k) | {a.metrics['synthetic'].pass1:.3f} | " \
           f"{b.metrics['synthetic'].pass1:.3f} | {delta:+.3f} |" in md
    urls = plot_history([("sft", a.metrics), ("rl-stage-1", b.metrics)], str(tmp_path / "hist"))
    assert len(urls) == 3 and all(storage.read_bytes(u).startswith(PNG) for u in urls)


def test_missing_benchmark_fails_before_any_sampling(tmp_path):
    cfg = synthetic_cfg(10)

    class Boom:
        def sample(self, *a):
            raise AssertionError("sampled before the benchmarks were checked")

    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        evaluate(cfg, checkpoint_url="x", out_url=str(tmp_path / "o"), benchmarks=[str(tmp_path / "absent.jsonl")],
                 sampler=Boom(), grade_math=exact_grader, progress=False)
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate(cfg, checkpoint_url="x", out_url=str(tmp_path / "o"), benchmarks=["aime99"], sampler=Boom(),
                 grade_math=exact_grader, progress=False)


def test_gpqa_fixture_end_to_end(tmp_path):
    cfg = synthetic_cfg(4)
    bench = load_benchmark(benchmark_from_url(str(FIX / "gpqa_diamond.jsonl")))
    sampler = ScriptedSampler({q.problem: q.answer for q in bench.problems}, 1.0)
    rep = evaluate(cfg, checkpoint_url="x", out_url=str(tmp_path / "g"), benchmarks=[str(FIX / "gpqa_diamond.jsonl")],
                   k=2, sampler=sampler, grade_math=exact_grader, progress=False)
    assert rep.metrics["gpqa_diamond"].pass1 == 1.0


def test_infrastructure_failures_are_counted_and_past_the_threshold_stop_the_evaluation(tmp_path):
    from eval_fakes import FlakySampler

    from rstar2_core.errors import InfraError, InfraFailureShareExceeded

    cfg = synthetic_cfg(40)
    bench = load_benchmark(cfg.eval.benchmarks[0], cfg)
    gold = {q.problem: q.answer for q in bench.problems}
    # 1 of k=8 samples per problem fails: 12.5% > the default 5%, so the measurement is refused (retryable)
    with pytest.raises(InfraFailureShareExceeded, match="eval.max_infra_failure_share") as err:
        evaluate(cfg, checkpoint_url="ckpt", out_url=str(tmp_path / "a"), k=8, sampler=FlakySampler(gold, 1.0, 1),
                 grade_math=exact_grader, progress=False)
    assert isinstance(err.value, InfraError)
    # below the threshold the report keeps the count: every failure scores 0, pass@1 is low by that share
    tolerant = synthetic_cfg(40, "eval.max_infra_failure_share=0.2")
    rep = evaluate(tolerant, checkpoint_url="ckpt", out_url=str(tmp_path / "b"), k=8,
                   sampler=FlakySampler(gold, 1.0, 1), grade_math=exact_grader, progress=False)
    m = rep.metrics["synthetic"]
    assert m.infra_failures == 40 and m.infra_failed_share == pytest.approx(1 / 8)
    assert m.pass1 == pytest.approx(7 / 8)
    assert all(r.infra_failed == 1 for r in rep.rows["synthetic"])
    assert rep.metrics["synthetic"].as_metrics()["eval/synthetic/infra_failed_share"] == pytest.approx(1 / 8)
    assert "infra-failed" in (tmp_path / "b" / "report.md").read_text()
    assert EvalReport.load(str(tmp_path / "b")).metrics["synthetic"].infra_failures == 40   # survives the JSON


def test_grader_failures_count_as_infrastructure_failures(tmp_path):
    from eval_fakes import Grade

    from rstar2_core.errors import InfraFailureShareExceeded

    cfg = synthetic_cfg(40)

    def dead_grader(items):          # a grader pool whose workers keep dying
        return [Grade(0.0, None, "grader_error") for _ in items]

    bench = load_benchmark(cfg.eval.benchmarks[0], cfg)
    with pytest.raises(InfraFailureShareExceeded, match="grader"):
        evaluate(cfg, checkpoint_url="ckpt", out_url=str(tmp_path / "a"), k=2, progress=False,
                 sampler=ScriptedSampler({q.problem: q.answer for q in bench.problems}, 1.0), grade_math=dead_grader)
