"""The isolation properties of a tool call (docs/sandbox-isolation.md), read from what a template found
it could do on this host (the `features` of its hello). The service refuses to start when its calls
would lack one that `sandbox.allow_missing_isolation` does not name (and logs the allowed missing ones);
`rstar2 sandbox doctor` prints them all; tests skip, with the reason, what a host cannot provide."""

from __future__ import annotations

from collections.abc import Iterable

PROPERTIES: dict[str, str] = {
    "minimal_root": "calls see only the interpreter, the allowed packages and their libraries, read-only",
    "no_capabilities": "calls hold no capability (bounding set empty too)",
    "private_tmp": "/tmp, /dev/shm and the cwd are fresh for each call and gone after it",
    "own_proc": "/proc shows only the call's own processes",
    "pid_namespace": "when a call ends, the kernel kills every process it started",
    "no_network": "calls have no network (an empty network namespace)",
    "private_abstract_sockets": "concurrent calls share no abstract Unix sockets (a network namespace per slot)",
    "private_ipc": "System V IPC and POSIX message queues are the call's own and gone after it (an IPC namespace per call)",
    "seccomp": "system calls no tool call needs are refused (seccomp filter)",
    "per_call_uid": "each running call has its own uid",
}


def properties(features: dict) -> dict[str, bool]:
    """Each property of PROPERTIES: whether calls of this template have it."""
    f = features
    return {"minimal_root": f.get("minimal_root") is not None, "no_capabilities": bool(f.get("caps_dropped")),
            "private_tmp": bool(f.get("private_tmp")), "own_proc": bool(f.get("own_proc")),
            "pid_namespace": bool(f.get("pidns")), "no_network": bool(f.get("netns")),
            "private_abstract_sockets": bool(f.get("netns_per_slot")), "private_ipc": bool(f.get("ipcns")),
            "seccomp": bool(f.get("seccomp")),
            "per_call_uid": bool(f.get("uid_drop"))}


def missing(features: dict, seccomp_why: str = "", allowed: Iterable[str] = ()) -> list[str]:
    """One line per property calls of this template lack (but those in `allowed`), with the host's
    reason where known."""
    out = []
    allowed = set(allowed)
    for name, ok in properties(features).items():
        if not ok and name not in allowed:
            why = seccomp_why if name == "seccomp" and seccomp_why else ""
            out.append(f"{name} ({PROPERTIES[name]})" + (f": {why}" if why else ""))
    return out
