"""`rstar2 cluster up|status|restart|down`: a multi-node Ray cluster on this machine, to rehearse a cluster run.

    rstar2 cluster up                  # head + the rehearsal's worker nodes (scripts/cluster-rehearsal.overrides)
    rstar2 cluster up --profile tiny --set cluster.nodes=3 --set cluster.gpus_per_node=2 ...
    rstar2 cluster status              # the live nodes and their resources
    rstar2 cluster restart             # start again the worker nodes that died (a rehearsed node loss)
    rstar2 cluster down                # stops every node by its PIDs

`up` sizes the nodes from the config's cluster section (rstar2_core/runtime/ray/rehearsal/local_cluster.py),
records them in `$RSTAR2_HOME/cluster/cluster.json` and prints the address to pass as `cluster.ray_address`.
See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rstar2_cli.common import add_override_args, read_overrides_file

REHEARSAL = Path(__file__).resolve().parents[1] / "scripts" / "cluster-rehearsal.overrides"


def rehearsal_overrides() -> list[str]:
    """The dotted overrides of scripts/cluster-rehearsal.overrides (comments and blank lines dropped)."""
    return read_overrides_file(REHEARSAL)


def _record() -> Path:
    from rstar2_core.config.root import resolve_state_dir

    return resolve_state_dir(None) / "cluster" / "cluster.json"


def _recorded() -> dict | None:
    """The recorded cluster (`LocalCluster.to_json()`), or None after saying there is none (on stderr)."""
    record = _record()
    if not record.exists():
        print(f"rstar2 cluster: no local cluster recorded ({record}); start one with `rstar2 cluster up`",
              file=sys.stderr)
        return None
    return json.loads(record.read_text())


def _up(args: argparse.Namespace) -> int:
    import tempfile

    from rstar2_core.config import load_config
    from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster

    record = _record()
    if record.exists():
        print(f"rstar2: a local cluster is already recorded in {record}; `rstar2 cluster down` first")
        return 1
    overrides = (rehearsal_overrides() if args.profile == "tiny" and not args.no_rehearsal else []) + args.overrides
    cfg = load_config(args.profile, overrides)
    cl = cfg.cluster
    if not cl.logical_gpus and cl.gpus_per_node:
        print("rstar2: a local cluster offers logical GPUs only; set cluster.logical_gpus = true")
        return 2
    root = Path(tempfile.mkdtemp(prefix="rstar2-cluster-", dir="/tmp"))   # Ray's socket paths must stay short
    cluster = LocalCluster.for_config(cfg.cluster, root, port=args.port)
    cluster.start()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(cluster.to_json(), indent=1))
    (record.parent / "cluster.env").write_text(f"export RAY_ADDRESS={cluster.address}\n")
    print(f"local Ray cluster up: head + {cl.nodes} worker node(s) x {cl.gpus_per_node} logical GPU, "
          f"{cl.cpus_per_node} CPU; logs in {root}")
    print(f"  address {cluster.address}: run with --set cluster.ray_address={cluster.address} "
          f"(or source {record.parent / 'cluster.env'}); stop with `rstar2 cluster down`")
    return 0


def _down(args: argparse.Namespace) -> int:
    import shutil

    from rstar2_core.runtime.ray.rehearsal.local_cluster import stop_recorded

    record, state = _record(), _recorded()
    if state is None:
        return 0
    pids = stop_recorded(state)
    record.unlink()
    (record.parent / "cluster.env").unlink(missing_ok=True)
    if str(state.get("root", "")).startswith("/tmp/rstar2-cluster-"):
        shutil.rmtree(state["root"], ignore_errors=True)
    print(f"local cluster at {state['address']} stopped ({len(pids)} process(es) signalled)")
    return 0


def _restart(args: argparse.Namespace) -> int:
    from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster

    state = _recorded()
    if state is None:
        return 1
    cluster = LocalCluster.attach(state)
    back = cluster.restart_dead_nodes()
    _record().write_text(json.dumps(cluster.to_json(), indent=1))
    print(f"restarted worker node(s) {back}" if back else "every worker node is running")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rstar2_core.runtime.layout import describe_nodes
    from rstar2_core.runtime.ray.connect import probe_cluster

    state = _recorded()
    if state is None:
        return 1
    print(f"local cluster at {state['address']}:")
    for line in describe_nodes(probe_cluster(state["address"])):
        print(f"  {line}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a multi-node Ray cluster on this machine (rehearse a cluster run)")
    csub = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    up = csub.add_parser("up", help="start a head and the config's worker nodes")
    up.add_argument("--profile", default="tiny", help="config profile sizing the nodes; default tiny")
    add_override_args(up)
    up.add_argument("--no-rehearsal", action="store_true",
                    help="do not apply scripts/cluster-rehearsal.overrides over the tiny profile")
    up.add_argument("--port", type=int, default=None, help="GCS port of the head (default: a free one)")
    up.set_defaults(func=_up)
    csub.add_parser("down", help="stop the recorded local cluster").set_defaults(func=_down)
    csub.add_parser("status", help="the live nodes of the recorded local cluster").set_defaults(func=_status)
    csub.add_parser("restart", help="start again the worker nodes that died (after a kill-node fault)"
                    ).set_defaults(func=_restart)
