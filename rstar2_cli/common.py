"""Arguments shared by CLI commands."""

from __future__ import annotations

import argparse


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="tiny", help="config profile in configs/ (or a .toml path); default tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. rl.stages.0.max_response_tokens=4096 (repeatable)")


def load(args: argparse.Namespace):
    from rstar2_core.config import load_config

    return load_config(args.profile, args.overrides)
