"""`rstar2 tools deploy|status|delete`: the tool service on a Ray cluster (docs/sandbox.md, "The tool service").

  rstar2 tools deploy --profile qwen3-14b-mi300x [--address HOST:6379] [--http-port 8000]
  rstar2 tools status --profile qwen3-14b-mi300x [--address HOST:6379] [--json]
  rstar2 tools delete --profile qwen3-14b-mi300x [--address HOST:6379]

`deploy` creates (or updates in place) the Serve application `sandbox.service.app_name` from the profile's
`[sandbox]` and `[sandbox.service]` sections and waits until every replica runs; the application outlives
the command (Serve keeps it in the cluster). Run it where a Ray driver can connect (e.g. the head).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rstar2_cli.common import add_profile_args, load


def tool_node(sc) -> dict:
    """A local cluster's tool node for `sc` (`sandbox.service`): CPUs for every replica it may run
    (`max(replicas, max_replicas)` x `cpus_per_replica`) and that many units of `node_resource`; the
    `LocalCluster` keywords (`tool_cpus`, `tool_resources`)."""
    top = max(sc.replicas, sc.max_replicas)
    return {"tool_cpus": max(1, math.ceil(top * sc.cpus_per_replica)),
            "tool_resources": {sc.node_resource: top} if sc.node_resource else {}}


def last_json(p, what: str) -> dict:
    """The JSON object on the last stdout line of the finished command `p` (a `subprocess.CompletedProcess`
    of `rstar2 tools ...`), or a RuntimeError naming `what`, its exit code and stderr's end."""
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"{what} gave no JSON (exit {p.returncode}): {p.stderr[-2000:]}") from None


def tools_command(action: str, profile: str, overrides: list[str], address: str, *extra: str) -> list[str]:
    """The `rstar2 tools <action>` command line for `profile` + `overrides` on the Ray cluster at `address`
    (what infra/k8s/up.sh runs, and the rehearsal and the chaos bench on their local clusters)."""
    sets = [x for o in overrides for x in ("--set", o)]
    return [str(Path(sys.executable).with_name("rstar2")), "tools", action, "--profile", profile, *sets,
            "--address", address, *extra]


def _connect(args: argparse.Namespace):
    """The profile's config (`sandbox.backend` must be "service") with this process connected to its Ray."""
    from rstar2_core.config import ConfigError
    from rstar2_core.runtime.ray.connect import ensure_ray

    cfg = load(args)
    if cfg.sandbox.backend != "service":
        raise ConfigError(f"profile {cfg.profile} has sandbox.backend = \"{cfg.sandbox.backend}\": the tool service is "
                          "for sandbox.backend = \"service\"; set it (and [sandbox.service]) or pick another profile")
    if args.address:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"ray_address": args.address})})
    ensure_ray(cfg.cluster)
    return cfg


def _deploy(args: argparse.Namespace) -> int:
    from rstar2_core.errors import ToolServiceRefused
    from rstar2_core.runtime.ray.tool_service import deploy_tool_service

    cfg = _connect(args)
    sc = cfg.sandbox.service
    print(f"deploying the tool service {sc.app_name!r}: {sc.replicas}"
          + (f"-{sc.max_replicas}" if sc.max_replicas else "") + f" replica(s) x {sc.cpus_per_replica:g} CPU"
          + (f" on nodes with {sc.node_resource!r}" if sc.node_resource else "")
          + f", HTTP {args.http_host}:{args.http_port}{sc.route_prefix} (waits up to {args.timeout_s:.0f} s)",
          file=sys.stderr, flush=True)
    try:
        st = deploy_tool_service(cfg.sandbox, http_host=args.http_host, http_port=args.http_port,
                                 timeout_s=args.timeout_s)
    except ToolServiceRefused as e:
        print(f"rstar2 tools deploy: refused: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"rstar2 tools deploy: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st))
    return 0


def _status(args: argparse.Namespace) -> int:
    from rstar2_core.runtime.ray.tool_service import tool_service_status

    cfg = _connect(args)
    st = tool_service_status(cfg.sandbox.service.app_name)
    if args.json:
        print(json.dumps(st))
    else:
        reps = ", ".join(f"{n} {k.lower()}" for k, n in st.get("replicas", {}).items()) or "no replicas"
        print(f"{cfg.sandbox.service.app_name}: {st['status']} ({reps})" + (f": {st['message']}" if st["message"] else ""))
    return 0 if st["status"] == "RUNNING" else 1


def _delete(args: argparse.Namespace) -> int:
    from rstar2_core.runtime.ray.tool_service import delete_tool_service

    cfg = _connect(args)
    delete_tool_service(cfg.sandbox.service.app_name)
    print(f"deleted {cfg.sandbox.service.app_name}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tools", help="deploy and check the tool service (the sandbox on CPU nodes of its own)")
    tsub = p.add_subparsers(dest="tools_command", required=True)
    for name, func, what in (("deploy", _deploy, "deploy or update the tool service and wait until it runs"),
                             ("status", _status, "the tool service's state and replicas (exit 1 unless running)"),
                             ("delete", _delete, "remove the tool service from the cluster")):
        q = tsub.add_parser(name, help=what)
        add_profile_args(q)
        q.add_argument("--address", default=None,
                       help="the Ray cluster's GCS address host:port (default: the profile's cluster.ray_address)")
        if name == "deploy":
            q.add_argument("--http-host", default="0.0.0.0", help="where Serve's HTTP proxy listens")
            q.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP port (default 8000)")
            q.add_argument("--timeout-s", type=float, default=300.0, help="how long to wait for every replica")
        if name == "status":
            q.add_argument("--json", action="store_true", help="one JSON object")
        q.set_defaults(func=func)
