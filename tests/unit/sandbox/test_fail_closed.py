"""Fail closed: a host that cannot provide an isolation property, or settings that turn one off, make
the service refuse to start (or a restarted template refuse calls) unless the property is named in
`sandbox.allow_missing_isolation`; with it named, the service starts and logs what calls lack."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_core.sandbox import ExecutionRequest, LocalSandbox, Status

ROOT = Path(__file__).resolve().parents[3]


def run(sb, code: str):
    return sb.run_sync(ExecutionRequest(code=code))


_NO_UNSHARE = """
import errno, json, logging, sys
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
f.add_rule(sc.ERRNO(errno.EPERM), "unshare")   # a host that forbids namespaces (an unprivileged container)
f.load()                                       # inherited by the templates this process starts
from rstar2_core.config import SandboxConfig
from rstar2_core.sandbox import ExecutionRequest, LocalSandbox, SandboxError
out = {}
try:
    LocalSandbox(SandboxConfig(workers=1, preload=["math"])).start()
    out["refused"] = None
except SandboxError as e:
    out["refused"] = str(e)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
allow = ["minimal_root", "private_tmp", "own_proc", "no_network", "private_abstract_sockets"]
with LocalSandbox(SandboxConfig(workers=1, preload=["math"], allow_missing_isolation=allow)) as sb:
    out["stdout"] = sb.run_sync(ExecutionRequest(code="print(6 * 7)")).stdout
print(json.dumps(out))
"""


def test_a_host_without_namespaces_is_refused_unless_allowed():
    """Fail closed: where the host refuses unshare (simulated with a seccomp filter on the service, as
    an unprivileged container would), calls would see the host's files and network. Before, the
    service started with a WARNING and ran them so; now start() refuses unless each lost property is
    named in allow_missing_isolation, and with them named it starts and logs them."""
    proc = subprocess.run([sys.executable, "-c", _NO_UNSHARE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["refused"] is not None, "the service started without namespaces"
    for prop in ("minimal_root", "private_tmp", "own_proc", "no_network", "private_abstract_sockets"):
        assert prop in out["refused"], out["refused"]
    assert "allow_missing_isolation" in out["refused"] and "unshare" in out["refused"], out["refused"]
    assert "seccomp (" not in out["refused"] and "pid_namespace" not in out["refused"]
    assert out["stdout"] == "42\n"
    warning = " ".join(ln for ln in lines if ln.startswith("LOG WARNING"))
    assert "minimal_root" in warning and "no_network" in warning, proc.stdout


def test_a_host_without_the_seccomp_filter_is_refused_unless_allowed(make_cfg, monkeypatch, caplog):
    """No libseccomp (simulated: compile_filter finds none): without the filter a call can make a user
    namespace and hold every capability in it. Refused unless seccomp is allowed to be missing."""
    from rstar2_core.sandbox import SandboxError, dispatcher
    from rstar2_core.sandbox.syscalls import Filter

    monkeypatch.setattr(dispatcher, "compile_filter", lambda: Filter(None, why="no seccomp filter: simulated"))
    with pytest.raises(SandboxError, match=r"seccomp .*simulated.*allow_missing_isolation = \['seccomp'\]"):
        LocalSandbox(make_cfg(preload=["math"])).start()
    with caplog.at_level(logging.WARNING, logger="rstar2.sandbox"), \
            LocalSandbox(make_cfg(preload=["math"], allow_missing_isolation=["seccomp"])) as box:
        r = run(box, "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')])")
    assert r.stdout == "['0']\n", r   # it says what it lacks: there is no filter
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "seccomp (" in warning and "simulated" in warning, warning


def test_a_template_restarted_with_less_isolation_runs_no_call(make_cfg, monkeypatch):
    """Fail closed after start-up too: a template that dies and comes back lacking a property (simulated:
    its hello reads as without the seccomp filter) is stopped, and calls of its kind get `internal`
    with the reason instead of running."""
    from rstar2_core.sandbox import dispatcher
    from rstar2_core.sandbox import properties as props

    real = props.properties
    with LocalSandbox(make_cfg(preload=["math"], workers=1)) as box:
        assert run(box, "print(1)").stdout == "1\n"
        weaker = lambda f: {**real(f), "seccomp": False}
        monkeypatch.setattr(props, "properties", weaker)
        monkeypatch.setattr(dispatcher, "properties", weaker)
        os.kill(box._d.templates["light"][0].proc.pid, 9)
        r = run(box, "print(2)")
        assert r.status is Status.INTERNAL and r.stdout == "", r
        assert "seccomp" in r.stderr and "allow_missing_isolation" in r.stderr, r.stderr
        assert run(box, "print(3)").status is Status.INTERNAL
        assert all(t.dead for t in box._d.templates["light"])


def test_settings_that_turn_isolation_off_must_allow_it(make_cfg, caplog):
    from pydantic import ValidationError

    for kw in ({"namespaces": False}, {"network": "host"}):
        with pytest.raises(ValidationError, match="allow_missing_isolation"):
            make_cfg(**kw)
    with pytest.raises(ValidationError):
        make_cfg(allow_missing_isolation=["no_such_property"])
    lost = ["minimal_root", "private_tmp", "own_proc", "pid_namespace", "no_network", "private_abstract_sockets",
            "private_ipc"]
    with caplog.at_level(logging.WARNING, logger="rstar2.sandbox"), \
            LocalSandbox(make_cfg(preload=["math"], namespaces=False, allow_missing_isolation=lost)) as box:
        f = box.features["light"]["features"]
    assert f["minimal_root"] is None and not f["private_tmp"]
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for prop in lost:
        assert prop in warning, warning
    assert "seccomp (" not in warning   # the filter needs no namespace: still installed


def test_the_config_names_every_isolation_property():
    from typing import get_args

    from rstar2_core.config.rollout_sections import IsolationProperty
    from rstar2_core.sandbox.properties import PROPERTIES

    assert list(get_args(IsolationProperty)) == list(PROPERTIES)


def test_scratch_zero_is_refused_when_calls_are_confined(make_cfg):
    from rstar2_core.sandbox import SandboxError

    with pytest.raises(SandboxError, match="scratch_mb"):
        LocalSandbox(make_cfg(preload=["math"], scratch_mb=0)).start()
    with LocalSandbox(make_cfg(preload=["math"], scratch_mb=0), confine=False) as box:   # host temp dirs
        assert run(box, "print(6 * 7)").stdout == "42\n"
