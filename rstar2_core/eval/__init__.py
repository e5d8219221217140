"""Evaluation: benchmark loaders per public layout, the paper's protocol (k samples, temperature 0.6,
tools on), metrics (avg@k, unbiased pass@k, length, tool use), reports and comparisons.

    from rstar2_core.eval.run import evaluate, EvalReport
    from rstar2_core.eval.report import compare_reports, plot_history

See docs/data-and-eval.md.
"""
