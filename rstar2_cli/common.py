"""Arguments and helpers shared by the command-line entry points (`rstar2 ...`, `python -m flows...`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def add_override_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. rl.stages.0.max_response_tokens=4096 (repeatable)")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="tiny", help="config profile in configs/ (or a .toml path); default tiny")
    add_override_args(p)


def load(args: argparse.Namespace):
    from rstar2_core.config import load_config

    return load_config(args.profile, args.overrides)


def step_logger() -> Callable[[dict, int], None]:
    """A `log_metrics(metrics, step)` callback printing one JSON line per step to stdout."""
    def log(metrics: dict, step: int) -> None:
        print(json.dumps({"step": step, **{k: round(float(v), 6) for k, v in sorted(metrics.items())}}), flush=True)

    return log


def read_overrides_file(path) -> list[str]:
    """The dotted overrides of a file of them, one per line (comments and blank lines dropped)."""
    from pathlib import Path

    return [x.strip() for x in Path(path).read_text().splitlines() if x.strip() and not x.lstrip().startswith("#")]

