"""`rstar2 data curate|show`: curate the RL problem set and print what each filter dropped.

    rstar2 data curate --profile tiny [--set data.max_answer_digits=12] [--out URL]
    rstar2 data show <dataset or manifest URL>

`curate` writes `<out>/<version>/problems.parquet` and `manifest.json` (default out:
`<storage root>/datasets/curated`) and prints the counts table and the dataset URL.
"""

from __future__ import annotations

import argparse
import sys

from rstar2_cli.common import add_profile_args, load


def counts_table(counts: dict) -> str:
    """Plain-text table: step, reason, rows (reads per source, drops per reason, kept)."""
    lines = [f"{'step':<16} {'reason / source':<40} {'rows':>8}", "-" * 66]
    for step, val in counts.items():
        if step in ("kept", "kept_by_source"):
            continue
        if isinstance(val, dict):
            if not val:
                lines.append(f"{step:<16} {'-':<40} {0:>8}")
            for reason, n in sorted(val.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"{step:<16} {reason:<40} {n:>8}")
    lines.append("-" * 66)
    for src, n in sorted(counts.get("kept_by_source", {}).items()):
        lines.append(f"{'kept':<16} {src:<40} {n:>8}")
    lines.append(f"{'kept':<16} {'total':<40} {counts.get('kept', 0):>8}")
    return "\n".join(lines)


def _curate(args: argparse.Namespace) -> int:
    from rstar2_core import storage
    from rstar2_core.data.curate import curate
    from rstar2_core.data.sources import SourceLayoutError
    from rstar2_core.eval.sampler import label_check_sampler

    cfg = load(args)
    storage.configure_from(cfg.storage)
    out = args.out or storage.join(cfg.resolved_storage_root(), "datasets", "curated")
    try:
        with label_check_sampler(cfg) as sampler:
            ref = curate(cfg, out, sampler=sampler)
    except (FileNotFoundError, SourceLayoutError) as e:
        print(f"rstar2 data curate: {e}", file=sys.stderr)
        return 2
    print(counts_table(ref.counts))
    print(f"\ndataset  {ref.url}\nmanifest {ref.manifest_url}\nversion  {ref.digest[:16]} ({ref.n_rows} rows)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from rstar2_core import storage

    url = args.url
    if url.endswith(".parquet"):
        url = url.rsplit("/", 1)[0]
    if not url.endswith(".json"):
        url = storage.join(url, "manifest.json")
    if not storage.exists(url):
        print(f"rstar2 data show: no manifest at {url}", file=sys.stderr)
        return 2
    m = storage.read_json(url)
    print(counts_table(m["counts"]))
    print(f"\ndataset {m['url']}\nversion {m['version']} ({m['n_rows']} rows)")
    for s in m["sources"]:
        print(f"source  {s['name']:<16} {s['layout']:<18} {s['rows']:>8} rows  sha256 {s['sha256'][:16]}  {s['url']}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="curate the RL problem set")
    dsub = p.add_subparsers(dest="data_command", required=True)
    cur = dsub.add_parser("curate", help="read sources, filter, write a versioned parquet + manifest")
    add_profile_args(cur)
    cur.add_argument("--out", default=None, help="output folder URL (default <storage root>/datasets/curated)")
    cur.set_defaults(func=_curate)
    show = dsub.add_parser("show", help="print the counts of a curated dataset's manifest")
    show.add_argument("url", help="dataset (problems.parquet), version folder or manifest.json URL")
    show.set_defaults(func=_show)
