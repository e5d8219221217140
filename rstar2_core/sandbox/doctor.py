"""`rstar2 sandbox doctor`: what isolation this host permits, from what the templates found at start-up
(properties.py) and from probe programs run in a real sandbox (each an attack; True = isolated)."""

from __future__ import annotations

import os
import platform
import socket
import sys
import tempfile

from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox.properties import PROPERTIES, missing, properties
from rstar2_core.sandbox.service import LocalSandbox, default_workers
from rstar2_core.sandbox.syscalls import compile_filter, describe
from rstar2_core.sandbox.types import ExecutionRequest, Status

_PROBES = {
    "pid_namespace": "import os; print(os.getpid() == 1)",
    "env_scrubbed": "import os; print('RSTAR2_DOCTOR_CANARY' not in os.environ)",
    "unprivileged_uid": "import os; print(os.getuid() != 0)",
    "cannot_write_service_files": "import os; print(not os.access({path!r}, os.W_OK))",
    "network_blocked": ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                        "    print(False)\nexcept OSError:\n    print(True)"),
    "cwd_private": "import os; print(os.listdir('.') == [])",
    "host_files_hidden": "import os; print(not any(os.path.exists(p) for p in ({path!r}, {planted!r}, '/etc/passwd')))",
    "no_capabilities": ("import ctypes\nh = (ctypes.c_uint32 * 2)(0x20080522, 0)\nd = (ctypes.c_uint32 * 6)()\n"
                        "ctypes.CDLL(None).capget(h, d)\nprint(not any(d))"),
    "tmp_written": "open('/tmp/rstar2-doctor', 'w').write('x'); open('/dev/shm/rstar2-doctor', 'w').write('x'); print(True)",
    "tmp_fresh_next_call": "import os; print(not os.path.exists('/tmp/rstar2-doctor') and not os.path.exists('/dev/shm/rstar2-doctor'))",
    "own_proc_only": "import os; print(os.path.isdir('/proc/1') and [p for p in os.listdir('/proc') if p.isdigit()] == ['1'])",
    "syscalls_filtered": ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "print(libc.ptrace(0, 0, 0, 0) == -1 and ctypes.get_errno() == errno.EPERM)"),
    "sympy_and_numpy_work": "import sympy, numpy\nprint(sympy.factorint(91) == {{7: 1, 13: 1}} and int(numpy.arange(4).sum()) == 6)",
}


def host_report(cfg: SandboxConfig) -> dict:
    """Properties per template kind, the root and filter in use, and the verdict of each probe."""
    os.environ["RSTAR2_DOCTOR_CANARY"] = "1"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    planted = tempfile.NamedTemporaryFile(prefix="rstar2-doctor-", dir="/tmp")  # noqa: SIM115 - closed below
    os.chmod(planted.name, 0o644)
    filt = compile_filter()
    report: dict = {"python": sys.version.split()[0], "kernel": platform.release(), "euid": os.geteuid(),
                    "cpus": os.cpu_count(), "workers": default_workers(cfg), "seccomp": describe(filt)}
    try:
        # every property allowed to be missing: the doctor reports what the service would refuse
        with LocalSandbox(cfg.model_copy(update={"workers": 1, "allow_missing_isolation": list(PROPERTIES)})) as sb:
            report["root_packages"] = list(sb._d.root_plan.packages) if sb._d.root_plan else []
            report["root_notes"] = list(sb._d.root_plan.notes) if sb._d.root_plan else []
            report["templates"] = {k: {"features": v.get("features"), "preloaded": v.get("preloaded"),
                                       "missing": v.get("missing"), "vm_mb": v.get("vm_mb"),
                                       "properties": properties(v.get("features") or {}),
                                       "missing_properties": missing(v.get("features") or {}, filt.why)}
                                   for k, v in sb.features.items()}
            probes = {}
            for name, code in _PROBES.items():
                res = sb.run_sync(ExecutionRequest(code=code.format(port=port, path=__file__, planted=planted.name),
                                                   id=name))
                probes[name] = res.stdout.strip() == "True" if res.status is Status.OK else f"{res.status.value}: {res.stderr[-200:]}"
            report["probes"] = probes
    finally:
        listener.close()
        planted.close()
        os.environ.pop("RSTAR2_DOCTOR_CANARY", None)
        for leftover in ("/tmp/rstar2-doctor", "/dev/shm/rstar2-doctor"):   # where /tmp is shared
            try:
                os.unlink(leftover)
            except OSError:
                pass
    report["property_descriptions"] = PROPERTIES
    return report
