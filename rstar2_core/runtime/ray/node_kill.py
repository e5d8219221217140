"""The `kill-node` fault's action, and the PID helpers it shares with the rehearsal harness.

`kill_local_raylet(node_id)` SIGKILLs a Ray node's raylet and every process below it at once, as a
vanished machine looks to Ray; the raylet must be a process of this machine (a local multi-node cluster,
rehearsal/local_cluster.py). Invariant: a process is recognised by its PID *and* its start time, and
only signalled while that PID is still the recorded process (never a reused PID). No Ray import: psutil.
See docs/cluster.md, "A lost node is a retryable failure".
"""

from __future__ import annotations

import signal


def kill_local_raylet(node_id: str) -> int:
    """SIGKILL Ray node `node_id` as a vanished machine: its raylet and every process below it (the
    node's actor workers) at once, if the raylet is a process of this machine (the `kill-node` fault of a
    local multi-node cluster); returns the raylet's PID. Refuses the head (it holds the GCS)."""
    import psutil

    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.info["name"] == "raylet" and f"--node_id={node_id}" in cmd:
            if any("node:__internal_head__" in c for c in cmd):
                raise ValueError(f"node {node_id[:8]} is the head (it holds the GCS): kill-node takes a worker node")
            kill_process_tree(p.pid)
            return p.pid
    raise ValueError(f"node {node_id[:8]}'s raylet is not a process of this machine: the kill-node fault "
                     "rehearses a lost node on a local multi-node cluster (`rstar2 cluster up`)")


def kill_process_tree(pid: int) -> None:
    """SIGKILL a raylet and every process below it (the node's actor workers) at once: a vanished machine.
    A raylet killed alone leaves its workers answering calls for seconds."""
    signal_recorded(start_times([*process_tree(pid), pid]), signal.SIGKILL)


def process_tree(pid: int) -> list[int]:
    """The PIDs of every process below `pid` ([] when it is gone)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def start_times(pids: list[int]) -> dict[int, float]:
    """{pid: start time} of the processes of `pids` that exist."""
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            pass
    return out


def signal_recorded(procs: dict[int, float], sig: int) -> list[int]:
    """Send `sig` to each recorded process that is still the same one (pid and start time); returns those."""
    import psutil

    sent = []
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                p.send_signal(sig)
                sent.append(pid)
        except psutil.NoSuchProcess:
            pass
    return sent
