"""`rstar2 deploy`: the `rstar2-cluster` work pool with infra's template and prefect.yaml's deployments on it.

    rstar2 deploy                                   # PREFECT_API_URL's server (in the head pod: the cluster's)
    rstar2 deploy --api-url http://127.0.0.1:4200/api --json

Safe to rerun; exits 1 naming what the server holds that is not ours (rstar2_cli/bringup.py).
See infra/README.md, step 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def _deploy(args: argparse.Namespace) -> int:
    from rstar2_cli.bringup import BringupError, bring_up

    try:
        report = bring_up(args.api_url, Path(args.template), Path(args.project_dir),
                          health_timeout_s=args.health_timeout_s, log=lambda m: print(m, file=sys.stderr))
    except BringupError as e:
        print(f"rstar2 deploy: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(report)) if args.json else
          f"work pool rstar2-cluster {report.pool_action}; deployments {', '.join(report.deployments)}; "
          f"workers online: {', '.join(report.workers_online) or 'none yet'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from rstar2_cli.bringup import HEALTH_TIMEOUT_S, ROOT, TEMPLATE

    p = sub.add_parser("deploy", help="create or update the rstar2-cluster work pool and deploy prefect.yaml onto it")
    p.add_argument("--api-url", default=None, help="the Prefect API (default: PREFECT_API_URL)")
    p.add_argument("--template", default=str(TEMPLATE), help="the pool's base job template (JSON)")
    p.add_argument("--project-dir", default=str(ROOT), help="the folder holding prefect.yaml")
    p.add_argument("--health-timeout-s", type=float, default=HEALTH_TIMEOUT_S,
                   help="how long to wait for the API's /health")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_deploy)
