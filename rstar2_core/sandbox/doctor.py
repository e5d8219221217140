"""`rstar2 sandbox doctor`: what isolation this host permits, checked by running probe programs in
a real sandbox (not by reading kernel settings alone)."""

from __future__ import annotations

import os
import platform
import socket
import sys

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.service import LocalSandbox, default_workers
from rstar2_core.sandbox.types import ExecutionRequest, Status

_PROBES = {
    "pid_namespace": "import os; print(os.getpid() == 1)",
    "env_scrubbed": "import os; print('RSTAR2_DOCTOR_CANARY' not in os.environ)",
    "unprivileged_uid": "import os; print(os.getuid() != 0)",
    "cannot_write_service_files": "import os; print(not os.access({path!r}, os.W_OK))",
    "network_blocked": ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                        "    print(False)\nexcept OSError:\n    print(True)"),
    "cwd_private": "import os; print(os.listdir('.') == [])",
}


def host_report(cfg: SandboxConfig) -> dict:
    """Features the templates found, and the verdict of each probe (True = isolated)."""
    os.environ["RSTAR2_DOCTOR_CANARY"] = "1"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    report: dict = {"python": sys.version.split()[0], "kernel": platform.release(), "euid": os.geteuid(),
                    "cpus": os.cpu_count(), "workers": default_workers(cfg)}
    try:
        with LocalSandbox(cfg.model_copy(update={"workers": 1})) as sb:
            report["templates"] = {k: {"features": v.get("features"), "preloaded": v.get("preloaded"),
                                       "missing": v.get("missing"), "vm_mb": v.get("vm_mb")}
                                   for k, v in sb.features.items()}
            probes = {}
            for name, code in _PROBES.items():
                res = sb.run_sync(ExecutionRequest(code=code.format(port=port, path=__file__), id=name))
                probes[name] = res.stdout.strip() == "True" if res.status is Status.OK else f"{res.status.value}: {res.stderr[-200:]}"
            report["probes"] = probes
    finally:
        listener.close()
        os.environ.pop("RSTAR2_DOCTOR_CANARY", None)
    return report
