"""`rstar2 sandbox run|doctor`: the Python tool service from the command line (docs/sandbox.md).

  rstar2 sandbox run [--workers N] [--timeout-s T] [--memory-mb M] < requests.jsonl > results.jsonl
  rstar2 sandbox doctor [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from rstar2_cli.common import add_profile_args, load


def _sandbox_cfg(args: argparse.Namespace):
    from pydantic import ValidationError

    from rstar2_core.config import ConfigError, SandboxConfig

    cfg = load(args).sandbox
    update = {k: v for k, v in (("workers", args.workers), ("timeout_s", args.timeout_s),
                                ("memory_mb", args.memory_mb)) if v is not None}
    try:
        return SandboxConfig.model_validate({**cfg.model_dump(), **update, "backend": "local"})
    except ValidationError as e:
        raise ConfigError(f"bad sandbox option: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from e


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rstar2_core.sandbox.jsonl import run_jsonl
    from rstar2_core.sandbox.service import LocalSandbox, SandboxError

    cfg = _sandbox_cfg(args)
    try:
        sb = LocalSandbox(cfg).start()
    except SandboxError as e:
        print(f"rstar2 sandbox: the service could not start: {e}", file=sys.stderr)
        return 1
    bar = tqdm(unit="call", file=sys.stderr, disable=args.quiet or not sys.stderr.isatty(), mininterval=1.0, desc="sandbox")
    try:
        counts = run_jsonl(sb, sys.stdin, sys.stdout, progress=lambda _: bar.update(1))
    finally:
        bar.close()
        sb.close()
    if not args.quiet:
        print("sandbox: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())), file=sys.stderr)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from rstar2_core.sandbox.doctor import host_report
    from rstar2_core.sandbox.service import SandboxError

    try:
        report = host_report(load(args).sandbox)
    except SandboxError as e:
        print(f"rstar2 sandbox doctor: the service could not start: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"python {report['python']}, kernel {report['kernel']}, euid {report['euid']}, "
          f"{report['cpus']} CPUs, {report['workers']} workers")
    print(report["seccomp"])
    if report["root_packages"]:
        print(f"packages in the calls' root: {', '.join(report['root_packages'])}")
    for note in report["root_notes"]:
        print(f"  note: {note}")
    for kind, t in report["templates"].items():
        f = t["features"]
        print(f"template {kind}: {t['vm_mb']} MiB mapped, root {f.get('minimal_root') or 'host'} "
              f"({f.get('root_mounts', 0)} mounts), preloaded {', '.join(t['preloaded'])}"
              + (f"; missing {'; '.join(t['missing'])}" if t["missing"] else ""))
        if kind == "light":
            for name, ok in t["properties"].items():
                print(f"  {name:26s} {'yes' if ok else 'NO '}  {report['property_descriptions'][name]}")
            for note in f.get("notes", []):
                print(f"  note: {note}")
        if t["missing_properties"]:
            print(f"  MISSING on this host: {'; '.join(t['missing_properties'])}")
    print("probes (True = isolated):")
    for name, ok in report["probes"].items():
        print(f"  {name:28s} {ok}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sandbox", help="run Python tool calls in the isolated sandbox")
    ssub = p.add_subparsers(dest="sandbox_command", required=True)
    run = ssub.add_parser("run", help="JSONL requests on stdin -> JSONL results on stdout, in order")
    add_profile_args(run)
    run.add_argument("--workers", type=int, default=None, help="concurrent calls (0 = one per core)")
    run.add_argument("--timeout-s", type=float, default=None, help="wall-clock limit per call (s)")
    run.add_argument("--memory-mb", type=int, default=None, help="address-space limit per call (MiB)")
    run.add_argument("--quiet", action="store_true", help="no progress bar or summary on stderr")
    run.set_defaults(func=_run)
    doc = ssub.add_parser("doctor", help="print which isolation features this host supports")
    add_profile_args(doc)
    doc.add_argument("--json", action="store_true", help="one JSON object instead of text")
    doc.set_defaults(func=_doctor)
