"""Arguments and helpers shared by the command-line entry points (`rstar2 ...`, `python -m flows...`)."""

from __future__ import annotations

import argparse
import json
import sys
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



def fail(command: str, message: str) -> int:
    """Print `rstar2 <command>: <message>` on stderr (one line for bad input, no traceback); exit status 2."""
    print(f"rstar2 {command}: {message}", file=sys.stderr)
    return 2


def input_problem(checkpoints: dict[str, str] | None = None, files: dict[str, str] | None = None,
                  outputs: dict[str, str] | None = None) -> str | None:
    """The first problem with a command's inputs, as one line naming the option and what to do, or None.

    `checkpoints`/`files`/`outputs` map an option (`--base`) to its URL: a checkpoint must be complete (its
    `_COMPLETE` marker), a file must exist, an output must be on a writable store (not http(s)). Checked
    before the heavy imports, so a typo costs seconds and nothing is written."""
    from rstar2_core import storage

    for opt, url in (outputs or {}).items():
        if url.startswith(("http://", "https://")):
            return f"{opt} {url}: http(s) URLs are read-only; write to a path, a file:// or an s3:// URL"
    for opt, url in (checkpoints or {}).items():
        if not storage.is_complete(url):
            return (f"{opt} {url} is not a complete checkpoint (no {storage.COMPLETE_MARKER} marker): check the URL, "
                    "or build it first (rstar2 model prepare, rstar2 sft train)")
    for opt, url in (files or {}).items():
        if not storage.exists(url):
            return f"{opt} {url}: no such file; check the URL"
    return None
