"""`LocalCluster` recognises its node processes by PID *and* start time: on a machine whose PIDs wrap
(32K here, within minutes under the test suite) a dead node's `ray start` PID can belong to another
process by the time the node is restarted. A node is down when its `ray start` has exited or its raylet
is gone (a `ray start` that lingers after its raylet died is killed before the node starts again)."""

import os
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from rstar2_core.runtime.ray.rehearsal import local_cluster
from rstar2_core.runtime.ray.rehearsal.local_cluster import LocalCluster, Node


def _cluster(tmp_path: Path, worker_pid: int, started: float) -> LocalCluster:
    c = LocalCluster(1, 2, 1, tmp_path, port=1)
    c.nodes = [Node("head", 0, [], tmp_path / "h.log", os.getpid(), {os.getpid(): psutil.Process().create_time()}),
               Node("worker", 1, [], tmp_path / "w.log", worker_pid, {worker_pid: started})]
    return c


@pytest.fixture
def no_launch(monkeypatch):
    launched: list = []
    monkeypatch.setattr(LocalCluster, "_launch", lambda self, node: launched.append(node.index) or node)
    return launched


@pytest.fixture
def raylet(tmp_path):
    """A child process of this one named `raylet` (a copy of `sleep`)."""
    exe = tmp_path / "raylet"
    shutil.copy(shutil.which("sleep"), exe)
    p = subprocess.Popen([str(exe), "60"])
    yield p
    p.kill()
    p.wait()


def test_a_dead_nodes_pid_reused_by_another_process_still_counts_as_dead(tmp_path, no_launch):
    me = psutil.Process()
    c = _cluster(tmp_path, me.pid, me.create_time() - 60)      # the recorded `ray start` started a minute earlier
    assert c.restart_dead_nodes() == [1] and no_launch == [1]


def test_a_running_node_is_not_restarted(tmp_path, raylet, monkeypatch):
    me = psutil.Process()                                       # this process plays `ray start`, with a raylet
    c = _cluster(tmp_path, me.pid, me.create_time())
    monkeypatch.setattr(LocalCluster, "_launch", lambda self, node: (_ for _ in ()).throw(AssertionError("launched")))
    assert not c.node_down(1) and c.restart_dead_nodes() == []
    assert "raylet [" in c.describe()


def test_a_node_whose_raylet_died_is_restarted_even_while_its_ray_start_lingers(tmp_path, no_launch, monkeypatch):
    lingering = subprocess.Popen(["sleep", "60"])               # a `ray start` whose raylet is gone
    try:
        c = _cluster(tmp_path, lingering.pid, psutil.Process(lingering.pid).create_time())
        c.nodes[1].procs = {lingering.pid: psutil.Process(lingering.pid).create_time()}
        monkeypatch.setattr(local_cluster, "RESTART_WAIT_S", 0.5)
        assert c.node_down(1) and "raylet none" in c.describe()
        assert c.restart_dead_nodes() == [1] and no_launch == [1]
        assert lingering.wait(timeout=10) == -9                 # killed once the wait ran out
    finally:
        lingering.kill()
        lingering.wait()
