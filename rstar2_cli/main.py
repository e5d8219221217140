"""`rstar2` command line. Each module in this package with a `register(subparsers)` function adds
one command group (config, grade, sandbox, data, eval, plan, ...); heavy imports happen inside the
handlers so that `rstar2 --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import rstar2_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rstar2", description="rStar2-Agent recipe: agentic RL with a Python tool.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(rstar2_cli.__path__), key=lambda m: m.name):
        if mod.name in ("main", "common") or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"rstar2_cli.{mod.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rstar2_core.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"rstar2: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
