"""`rstar2 eval` and `rstar2 eval-compare`: evaluate a checkpoint and compare two reports.

    rstar2 eval --model models:/rstar2-agent@champion --bench aime24 [--bench math500] [--k 16] \\
                [--profile production] [--set eval.max_tokens=30000] [--out URL]
    rstar2 eval --model file:///.../rl-stage-3/final --bench ./aime_2025.jsonl --layout aime
    rstar2 eval-compare <report A> <report B> [--out diff.md] [--allow-mismatch]

Invariant: the model reference and every benchmark are checked before the model is loaded (a bad one
exits 2 saying what to fix), and `eval-compare` refuses (exit 2) two reports not measured the same way
unless `--allow-mismatch`. See docs/data-and-eval.md (`rstar2 eval`, `rstar2 eval-compare`).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from rstar2_cli.common import add_profile_args, load

_FILE_LAYOUTS = ["aime", "generic", "gpqa", "hmmt", "math500"]  # rstar2_core.data.benchmarks.LOADERS (tested)


def _default_out(cfg, model_ref: str) -> str:
    from rstar2_core import storage

    tag = re.sub(r"[^A-Za-z0-9_.@-]+", "-", model_ref.rstrip("/").rsplit("/", 1)[-1].replace("models:", ""))
    return storage.join(cfg.resolved_storage_root(), "eval", f"{tag or 'model'}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")


def _eval(args: argparse.Namespace) -> int:
    from rstar2_core import storage
    from rstar2_core.data.benchmarks import benchmark_from_url, load_benchmark, resolve_benchmarks
    from rstar2_core.data.sources import SourceLayoutError
    from rstar2_core.eval.report import metrics_table
    from rstar2_core.eval.run import evaluate
    from tasks.modelref import ModelRefError, resolve_model_ref

    cfg = load(args)
    storage.configure_from(cfg.storage)
    try:
        ckpt = resolve_model_ref(args.model, cfg.resolved_tracking_uri())
        names = [benchmark_from_url(b, layout=args.layout) if args.layout else b for b in args.bench]
        benches = resolve_benchmarks(cfg, names)
        for bc in benches:
            b = load_benchmark(bc, cfg)
            if not b.problems:
                raise ValueError(f"benchmark {b.name!r} has no usable problems (rejected: {dict(b.rejected)})")
    except (ModelRefError, FileNotFoundError, SourceLayoutError, ValueError) as e:
        print(f"rstar2 eval: {e}", file=sys.stderr)
        return 2
    out = args.out or _default_out(cfg, args.model)
    print(f"evaluating {ckpt} on {[b.name for b in benches]} (k={args.k or cfg.eval.k}) -> {out}", file=sys.stderr)
    report = evaluate(cfg, checkpoint_url=ckpt, out_url=out, benchmarks=benches, k=args.k)
    print(metrics_table(report.metrics))
    print(f"\nreport {report.report_url}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from rstar2_core import storage
    from rstar2_core.eval.metrics import EvalReport
    from rstar2_core.eval.report import ReportsNotComparable, diff_markdown

    try:
        a, b = EvalReport.load(args.a), EvalReport.load(args.b)
        md = diff_markdown(a, b, (args.label_a, args.label_b), allow_mismatch=args.allow_mismatch)
    except (FileNotFoundError, ValueError) as e:
        hint = " (--allow-mismatch)" if isinstance(e, ReportsNotComparable) else ""
        print(f"rstar2 eval-compare: {e}{hint}", file=sys.stderr)
        return 2
    if args.out:
        storage.write_text_atomic(args.out, md)
    print(md)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint or registered model on benchmarks")
    add_profile_args(p)
    p.add_argument("--model", required=True, help="checkpoint URL/path, or models:/NAME@ALIAS / models:/NAME/VERSION")
    p.add_argument("--bench", action="append", default=[], metavar="NAME_OR_URL",
                   help="configured benchmark name or .jsonl/.parquet URL (repeatable; default: all configured)")
    p.add_argument("--layout", default=None, choices=_FILE_LAYOUTS,
                   help="layout of --bench files given by URL (default: detected from the fields)")
    p.add_argument("--k", type=int, default=None, help="samples per problem (default eval.k; the paper: 16)")
    p.add_argument("--out", default=None, help="report folder URL")
    p.set_defaults(func=_eval)
    c = sub.add_parser("eval-compare", help="compare two evaluation reports (per-problem diff)")
    c.add_argument("a", help="report folder or report.json of the baseline")
    c.add_argument("b", help="report folder or report.json of the candidate")
    c.add_argument("--label-a", default="A")
    c.add_argument("--label-b", default="B")
    c.add_argument("--out", default=None, help="also write the markdown here")
    c.add_argument("--allow-mismatch", action="store_true",
                   help="compare reports measured differently (k, temperature, limits, benchmark content) anyway; "
                        "the diff then names what differs")
    c.set_defaults(func=_compare)
