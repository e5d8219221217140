"""`rstar2 config show|profiles`: print the resolved config tree, or a recipe run's frozen config.

    rstar2 config show --profile tiny [--set rl.lr=1e-4]     # the profile as it would run now
    rstar2 config show --run <run id> [--storage-root URL]   # what run <run id> runs (its config snapshot)

A run's snapshot is read from `<storage root>/runs/<run id>/state/config.json` (default storage root:
the profile-independent `file://<state dir>/artifacts`; pass `--storage-root` for a profile whose
`storage.root` is elsewhere, e.g. `s3://...`). It prints the snapshot record (digest, profile,
overrides, git SHA, config), then exits 2 when this code no longer validates it (the error names the field).
"""

from __future__ import annotations

import argparse
import json
import sys

from rstar2_cli.common import add_profile_args, load


def _show(args: argparse.Namespace) -> int:
    if args.run:
        return _show_run(args)
    from rstar2_core.config import config_to_toml_dict

    cfg = load(args)
    tree = config_to_toml_dict(cfg)
    tree["resolved"] = {"state_dir": str(cfg.resolved_state_dir()), "storage_root": cfg.resolved_storage_root(),
                        "tracking_uri": cfg.resolved_tracking_uri()}
    print(json.dumps(tree, indent=2))
    return 0


def _show_run(args: argparse.Namespace) -> int:
    from rstar2_core.config import StorageConfig, resolve_storage_root
    from tasks.run_config import read_snapshot
    from tasks.run_store import RunStore

    if args.overrides:
        print("rstar2 config show: --set does not apply to --run (a run's config is frozen)", file=sys.stderr)
        return 2
    root = args.storage_root or resolve_storage_root(None, StorageConfig())
    store = RunStore.for_run(root, args.run)
    record = store.read_config_snapshot()
    if record is None:
        print(f"rstar2 config show: run {args.run!r} has no config snapshot at {store.config_url()}; check the "
              "run id (a Prefect flow run id or the run_id parameter) and --storage-root", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=2))
    read_snapshot(store)  # raises ConfigError (exit 2, the field named) when this code no longer validates it
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from rstar2_core.config import available_profiles

    print("\n".join(available_profiles()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the resolved config")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config (or a run's frozen config) as JSON")
    add_profile_args(show)
    show.add_argument("--run", default=None, metavar="RUN_ID", help="print this recipe run's config snapshot")
    show.add_argument("--storage-root", default=None, metavar="URL",
                      help="storage root holding the run (default file://<state dir>/artifacts)")
    show.set_defaults(func=_show)
    prof = csub.add_parser("profiles", help="list the profiles in configs/")
    prof.set_defaults(func=_profiles)
