"""`rstar2 config show|profiles`: print the resolved config tree."""

from __future__ import annotations

import argparse
import json

from rstar2_cli.common import add_profile_args, load


def _show(args: argparse.Namespace) -> int:
    from rstar2_core.config import config_to_toml_dict

    cfg = load(args)
    tree = config_to_toml_dict(cfg)
    tree["resolved"] = {"state_dir": str(cfg.resolved_state_dir()), "storage_root": cfg.resolved_storage_root(),
                        "tracking_uri": cfg.resolved_tracking_uri()}
    print(json.dumps(tree, indent=2))
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from rstar2_core.config import available_profiles

    print("\n".join(available_profiles()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the resolved config")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config as JSON")
    add_profile_args(show)
    show.set_defaults(func=_show)
    prof = csub.add_parser("profiles", help="list the profiles in configs/")
    prof.set_defaults(func=_profiles)
