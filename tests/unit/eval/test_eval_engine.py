"""avg@k through the real agent loop, sandbox, chat format and grader, with an engine of known accuracy."""

import pytest
from eval_fakes import KnownAccuracyEngine, build_tokenizer

from rstar2_core.config import load_config
from rstar2_core.data.benchmarks import load_benchmark
from rstar2_core.eval.run import evaluate
from rstar2_core.eval.sampler import PolicySampler


def grade_in_process(items):
    from rstar2_core.reward import grade_response

    return [grade_response(t, g) for t, g in items]


@pytest.mark.slow
def test_avg_at_k_through_the_agent_loop(tmp_path):
    from rstar2_core.chat import ChatFormat

    cfg = load_config("tiny", ["data.synthetic.n_eval=10", "eval.benchmarks.0.limit=10", "sandbox.workers=1"])
    bench = load_benchmark(cfg.eval.benchmarks[0], cfg)
    tok = build_tokenizer()
    gold = {p.problem: p.answer for p in bench.problems}
    results = {}
    for p in (0.0, 0.5, 1.0):
        engine = KnownAccuracyEngine(tok, gold, p)
        with PolicySampler(engine, ChatFormat(tok), cfg.sandbox) as sampler:
            rep = evaluate(cfg, checkpoint_url=f"p{p}", out_url=str(tmp_path / str(p)), k=4, sampler=sampler,
                           grade_math=grade_in_process, progress=False)
        m = rep.metrics["synthetic"]
        assert len(engine.decisions) == 40
        assert m.pass1 == pytest.approx(sum(ok for _, ok in engine.decisions) / 40)
        for row in rep.rows["synthetic"]:
            problem = next(q.problem for q in bench.problems if q.id == row.id)
            assert row.n_correct == sum(ok for q, ok in engine.decisions if q == problem)
        assert m.tool_calls_per_traj == 1.0 and m.tool_error_ratio == 0.0 and m.truncation_rate == 0.0
        results[p] = rep
    assert results[0.0].metrics["synthetic"].pass1 == 0.0 and results[1.0].metrics["synthetic"].pass1 == 1.0
    assert 0.2 < results[0.5].metrics["synthetic"].pass1 < 0.8
    # the same seed gives the same table
    engine = KnownAccuracyEngine(tok, gold, 0.5)
    with PolicySampler(engine, ChatFormat(tok), cfg.sandbox) as sampler:
        again = evaluate(cfg, checkpoint_url="p0.5", out_url=str(tmp_path / "again"), k=4, sampler=sampler,
                         grade_math=grade_in_process, progress=False)
    assert again.rows == results[0.5].rows


@pytest.mark.slow
def test_label_check_in_curation_through_the_agent_loop(tmp_path):
    from rstar2_core.chat import ChatFormat
    from rstar2_core.data.curate import curate, read_all_sources, read_dataset

    cfg = load_config("tiny", ["data.synthetic.n_rl=6", "data.synthetic.n_eval=4", "data.label_check.enabled=true",
                               "data.label_check.k=3", "data.label_check.min_agree=2", "sandbox.workers=1"])
    cands = [c for r in read_all_sources(cfg) for c in r.candidates]
    tok = build_tokenizer()
    gold = {c.problem: c.answer for c in cands}
    with PolicySampler(KnownAccuracyEngine(tok, gold, 1.0), ChatFormat(tok), cfg.sandbox) as sampler:
        ref = curate(cfg, str(tmp_path / "all"), sampler=sampler, progress=False)
    assert ref.n_rows == 6 and ref.counts["label_check"] == {}
    engine = KnownAccuracyEngine(tok, gold, 0.5)
    with PolicySampler(engine, ChatFormat(tok), cfg.sandbox) as sampler:
        ref = curate(cfg, str(tmp_path / "half"), sampler=sampler, progress=False)
    agree = {p: sum(ok for q, ok in engine.decisions if q == p) for p in gold}
    assert sorted(r["problem"] for r in read_dataset(ref.url)) == sorted(p for p, n in agree.items() if n >= 2)
    assert ref.counts["label_check"].get("label_disagree", 0) == sum(n < 2 for n in agree.values())
