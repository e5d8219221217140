"""Evaluation: the paper's protocol (k samples, temperature 0.6, tools on) over the benchmarks of
`rstar2_core.data.benchmarks`, metrics (avg@k, unbiased pass@k, length, tool use), reports, paired
comparisons of two reports and the promotion rule.

    from rstar2_core.eval.run import evaluate                              # -> eval.metrics.EvalReport
    from rstar2_core.eval.report import diff_markdown, plot_history        # markdown diff, plots
    from rstar2_core.eval.compare import compare_benchmark, rank_checkpoints
    from rstar2_core.eval.promotion import decide_promotion

See docs/data-and-eval.md.
"""
