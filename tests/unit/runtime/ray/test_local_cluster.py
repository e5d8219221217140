"""`LocalCluster` recognises its node processes by PID *and* start time: on a machine whose PIDs wrap
(32K here, within minutes under the test suite) a dead node's `ray start` PID can belong to another
process by the time the node is restarted."""

import os
from pathlib import Path

import psutil

from rstar2_core.runtime.ray.local_cluster import LocalCluster, Node


def _cluster(tmp_path: Path, worker_pid: int, started: float) -> LocalCluster:
    c = LocalCluster(1, 2, 1, tmp_path, port=1)
    c.nodes = [Node("head", 0, [], tmp_path / "h.log", os.getpid(), {os.getpid(): psutil.Process().create_time()}),
               Node("worker", 1, [], tmp_path / "w.log", worker_pid, {worker_pid: started})]
    return c


def test_a_dead_nodes_pid_reused_by_another_process_still_counts_as_dead(tmp_path, monkeypatch):
    me = psutil.Process()
    c = _cluster(tmp_path, me.pid, me.create_time() - 60)      # the recorded `ray start` started a minute earlier
    restarted = []
    monkeypatch.setattr(LocalCluster, "_launch", lambda self, node: restarted.append(node.index) or node)
    assert c.restart_dead_nodes() == [1] and restarted == [1]


def test_a_running_node_is_not_restarted(tmp_path, monkeypatch):
    me = psutil.Process()
    c = _cluster(tmp_path, me.pid, me.create_time())
    monkeypatch.setattr(LocalCluster, "_launch", lambda self, node: (_ for _ in ()).throw(AssertionError("launched")))
    assert c.restart_dead_nodes() == []
