"""A multi-node Ray cluster on this machine: a head and N worker nodes, each its own raylet with its own
logical resources, so placement across nodes, cross-node object transfer and the loss of a node are
Ray's real ones. What `rstar2 cluster up` starts and what the multi-node tests run on.

    with LocalCluster(workers=2, cpus_per_node=4, gpus_per_node=1, root=tmp) as c:   # head + 2 workers
        c.kill_node(1); c.restart_node(1)       # a lost node; the node back with the same resources

Invariant: every node is one `ray start --block` process, recorded with its start time and signalled
only while that PID is still the same process (never a reused PID); `node_command` is the one place the
`ray start` arguments are written. See docs/cluster.md, "The local cluster harness".
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self

from rstar2_core.runtime.ray.connect import RUNTIME_RESOURCE
from rstar2_core.runtime.ray.node_kill import kill_process_tree, process_tree, signal_recorded, start_times

if TYPE_CHECKING:
    from rstar2_core.config.pipeline_sections import ClusterConfig

HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
OBJECT_STORE_BYTES = 128 * 1024 * 1024
START_TIMEOUT_S = 120.0
RESTART_WAIT_S = 30.0
STARTED = "Ray runtime started"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def node_command(role: str, *, port: int, num_cpus: int, num_gpus: int = 0, temp_dir: str,
                 object_store_bytes: int = OBJECT_STORE_BYTES, resources: dict[str, float] | None = None) -> list[str]:
    """The `ray start --block` command of a head (`role="head"`, GCS on `port`), a worker node joining
    127.0.0.1:`port`, or a tool node (`role="tools"`: a worker declaring `resources`, where the tool service's
    replicas go; see the module docstring)."""
    cmd = [_ray_bin(), "start", "--block", "--disable-usage-stats", f"--num-cpus={num_cpus}",
           f"--num-gpus={num_gpus}", f"--temp-dir={temp_dir}", f"--object-store-memory={object_store_bytes}"]
    if role == "head":
        cmd += ["--head", f"--port={port}", "--include-dashboard=false",
                f"--resources={json.dumps({RUNTIME_RESOURCE: 1})}", f"--system-config={json.dumps(HEALTH_CHECK)}"]
    elif role == "worker":
        cmd += [f"--address=127.0.0.1:{port}"]
    elif role == "tools":
        cmd += [f"--address=127.0.0.1:{port}", f"--resources={json.dumps(resources or {})}"]
    else:
        raise ValueError(f"role must be 'head', 'worker' or 'tools', not {role!r}")
    return cmd


@dataclass
class Node:
    role: str
    index: int
    command: list[str]
    log: Path
    pid: int = 0
    procs: dict[int, float] = field(default_factory=dict)   # the `ray start` process and its children, once
    #                                                        up: pid -> start time (`psutil` create_time)


class LocalCluster:
    """A head and `workers` worker nodes on 127.0.0.1 (see the module docstring). `root`: where the
    nodes' logs and Ray's session folder go (Ray's socket paths must stay short: keep it under /tmp)."""

    def __init__(self, workers: int, cpus_per_node: int, gpus_per_node: int, root: str | Path, *,
                 head_cpus: int = 2, port: int | None = None, env: dict[str, str] | None = None,
                 tool_cpus: int = 0, tool_resources: dict[str, float] | None = None):
        """`tool_cpus` > 0: one more node after the workers, a tool node of that many CPUs and no GPU declaring
        `tool_resources` (the tool service's own node)."""
        if workers < 1:
            raise ValueError("a local cluster needs at least one worker node")
        self.workers, self.cpus, self.gpus, self.head_cpus = workers, cpus_per_node, gpus_per_node, head_cpus
        self.tool_cpus, self.tool_resources = tool_cpus, dict(tool_resources or {})
        self.root = Path(root)
        self.port = port or _free_port()
        self.temp_dir = str(self.root / "ray")
        self.env = {**os.environ, **(env or {}), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.nodes: list[Node] = []

    @classmethod
    def for_config(cls, cl: ClusterConfig, root: str | Path, **kwargs) -> LocalCluster:
        """The cluster a config's layout runs on (`cl` is its `cluster` section): `cl.nodes` workers of
        `cl.gpus_per_node` GPUs and `cl.cpus_per_node` CPUs; a head with the largest pipeline task's CPUs
        (`cl.resources`) + 1: the stage tasks run there (the runtime slot), and the workers' CPUs go to the
        layout."""
        head = math.ceil(max((r.num_cpus for r in cl.resources.values()), default=1.0)) + 1
        return cls(cl.nodes, cl.cpus_per_node, cl.gpus_per_node, root, head_cpus=head, **kwargs)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spec(self, role: str, index: int) -> Node:
        cpus, gpus = {"head": (self.head_cpus, 0), "tools": (self.tool_cpus, 0)}.get(role, (self.cpus, self.gpus))
        cmd = node_command(role, port=self.port, num_cpus=cpus, num_gpus=gpus, temp_dir=self.temp_dir,
                           resources=self.tool_resources if role == "tools" else None)
        return Node(role, index, cmd, self.root / f"{role}-{index}.log")

    def _launch(self, node: Node) -> Node:
        node.log.parent.mkdir(parents=True, exist_ok=True)
        start = node.log.stat().st_size if node.log.exists() else 0    # a restart appends: read only what is new
        with open(node.log, "ab") as out:
            proc = subprocess.Popen(node.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        node.pid = proc.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start ({node.role} {node.index}) exited with {proc.returncode}; "
                                   f"its log: {node.log}")
            with open(node.log, "rb") as f:
                f.seek(start)
                if STARTED.encode() in f.read():
                    node.procs = start_times([node.pid, *process_tree(node.pid)])
                    return node
            time.sleep(0.25)
        signal_recorded(start_times([node.pid, *process_tree(node.pid)]), signal.SIGKILL)
        raise TimeoutError(f"ray start ({node.role} {node.index}) not up within {START_TIMEOUT_S:.0f} s; "
                           f"its log: {node.log}")

    def start(self) -> Self:
        """Start the head, then the workers (each waits for its node to report started)."""
        try:
            self.nodes = [self._launch(self._spec("head", 0))]
            for i in range(1, self.workers + 1):
                self.nodes.append(self._launch(self._spec("worker", i)))
            if self.tool_cpus:
                self.nodes.append(self._launch(self._spec("tools", self.workers + 1)))
        except BaseException:
            self.stop()
            raise
        return self

    def raylet_pid(self, index: int) -> int:
        """The raylet of node `index` (0 = head)."""
        node = self.nodes[index]
        for pid in process_tree(node.pid):
            if _name(pid) == "raylet":
                return pid
        raise RuntimeError(f"node {index} has no running raylet")

    def node_id(self, index: int) -> str:
        """The Ray node id of node `index` (0: the head), read from its raylet's command line."""
        import psutil

        cmd = psutil.Process(self.raylet_pid(index)).cmdline()
        return next(c.split("=", 1)[1] for c in cmd if c.startswith("--node_id="))

    def kill_node(self, index: int) -> None:
        """SIGKILL worker node `index`'s raylet and its actor workers (what a vanished machine looks like
        to Ray); its `ray start` process then stops the node's other processes and exits."""
        if index < 1:
            raise ValueError("kill_node takes a worker node (1..workers): the head holds the GCS")
        node = self.nodes[index]
        kill_process_tree(self.raylet_pid(index))
        _wait_gone(node.pid, node.procs.get(node.pid), 30.0)
        signal_recorded(node.procs, signal.SIGKILL)

    def node_down(self, index: int) -> bool:
        """Whether worker node `index` is lost: its `ray start` process has exited, or its raylet is gone
        (Ray has lost the node; its `ray start` notices within a second or two and exits)."""
        node = self.nodes[index]
        if not _alive(node.pid, node.procs.get(node.pid)):
            return True
        return not any(_name(pid) == "raylet" for pid in process_tree(node.pid))

    def restart_node(self, index: int) -> None:
        """Start worker node `index` again (a new raylet with the same resources). A node whose raylet is
        gone but whose `ray start` has not exited yet is waited for (`RESTART_WAIT_S`), then killed."""
        node = self.nodes[index]
        if not self.node_down(index):
            raise RuntimeError(f"node {index} is still running (pid {node.pid})")
        _wait_gone(node.pid, node.procs.get(node.pid), RESTART_WAIT_S)
        signal_recorded(node.procs, signal.SIGKILL)
        self.nodes[index] = self._launch(self._spec(node.role, index))

    def restart_dead_nodes(self) -> list[int]:
        """Start again every worker node that is down (`node_down`: its raylet or its `ray start` process
        died); returns their indices. The process is recognised by its start time: its PID may already be
        another process's (the test suite's processes wrap a 32K PID space within minutes)."""
        dead = [n.index for n in self.nodes[1:] if self.node_down(n.index)]
        for i in dead:
            self.restart_node(i)
        return dead

    def describe(self, log_lines: int = 15) -> str:
        """Each node's processes (alive or not, its raylet's PID) and the last `log_lines` lines of its log:
        what a failing test prints so that a node's fate can be read from the CI output alone."""
        out = []
        for n in self.nodes:
            alive = _alive(n.pid, n.procs.get(n.pid))       # a dead node's PID may be another process's now
            raylets = [pid for pid in process_tree(n.pid) if _name(pid) == "raylet"] if alive else []
            out.append(f"--- {n.role} {n.index}: ray start pid {n.pid} "
                       f"{'alive' if alive else 'gone'}, raylet {raylets or 'none'}, "
                       f"log {n.log}")
            try:
                out += n.log.read_text(errors="replace").splitlines()[-log_lines:]
            except OSError as e:
                out.append(f"(log unreadable: {e})")
        return "\n".join(out)

    def stop(self) -> None:
        """Stop every node by its PIDs: SIGTERM (workers first, then the head), then SIGKILL what is left."""
        stop_recorded(self.to_json())
        self.nodes = []

    def to_json(self) -> dict:
        return {"address": self.address, "root": str(self.root), "temp_dir": self.temp_dir, "port": self.port,
                "workers": self.workers, "cpus_per_node": self.cpus, "gpus_per_node": self.gpus,
                "head_cpus": self.head_cpus, "tool_cpus": self.tool_cpus, "tool_resources": self.tool_resources,
                "nodes": [{"role": n.role, "index": n.index, "pid": n.pid, "procs": n.procs, "log": str(n.log),
                           "command": n.command} for n in self.nodes]}

    @classmethod
    def attach(cls, state: dict) -> LocalCluster:
        """The cluster a `to_json()` record describes, its nodes as recorded (to restart the dead ones
        from another process: `rstar2 cluster restart`)."""
        c = cls(state["workers"], state["cpus_per_node"], state["gpus_per_node"], state["root"],
                head_cpus=state["head_cpus"], port=state["port"], tool_cpus=state.get("tool_cpus", 0),
                tool_resources=state.get("tool_resources"))
        c.nodes = [Node(n["role"], n["index"], list(n["command"]), Path(n["log"]), n["pid"],
                        {int(p): t for p, t in n["procs"].items()}) for n in state["nodes"]]
        return c

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_recorded(state: dict) -> list[int]:
    """Stop the nodes a `LocalCluster.to_json()` record lists (`rstar2 cluster down`, `LocalCluster.stop`):
    SIGTERM each `ray start` process (workers first), then SIGKILL what is left of each node's processes;
    returns the PIDs signalled. A PID is only signalled while it is the process the record names (same
    start time), never a reused one."""
    signalled = []
    nodes = [(n["pid"], {int(p): t for p, t in n["procs"].items()}) for n in reversed(state.get("nodes", []))]
    for pid, procs in nodes:
        signalled += signal_recorded({p: t for p, t in procs.items() if p == pid}, signal.SIGTERM)
    for pid, procs in nodes:
        _wait_gone(pid, procs.get(pid), 20.0)
        signalled += signal_recorded(procs, signal.SIGKILL)
    return signalled


# ----------------------------------------------------------------------------------------- processes
def _name(pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return ""


def _alive(pid: int, started: float | None) -> bool:
    """Whether `pid` runs (not a zombie) and is still the recorded process: started at `started` (its
    `create_time`; None when unrecorded: any process with that PID)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return (started is None or p.create_time() == started) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pid: int, started: float | None, timeout_s: float) -> None:
    """Wait until the recorded process `pid` has exited, then reap it if it is our child (only when the PID
    was still that process: a reused PID may be another child of ours)."""
    import psutil

    try:
        ours = started is None or psutil.Process(pid).create_time() == started
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + timeout_s
    while _alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.1)
    if ours:
        try:
            os.waitpid(pid, os.WNOHANG)    # reap our own child, if it is one
        except ChildProcessError:
            pass
