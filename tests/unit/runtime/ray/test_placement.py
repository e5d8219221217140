"""Placement groups and ActorGroup on a local Ray: a killed actor surfaces as a retryable ActorFailure,
the group is shut down with it (no actor process left), placement groups are freed, a layout the
cluster cannot hold times out with a message listing the free resources, and an actor whose constructor
raises a ValueError/TypeError (bad config) fails with ActorConfigError, which is not retried (the error
class named by its traceback is never imported); every actor death this layer knows is retried by the
pipeline's rule."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from rstar2_core.config import load_config
from rstar2_core.runtime.layout import LayoutError
from rstar2_core.runtime.ray.errors import (
    ActorConfigError,
    ActorFailure,
    ActorStartTimeout,
    LayoutDoesNotFit,
    PlacementTimeout,
)
from rstar2_core.runtime.specs import layout_for
from tasks import retry

pytestmark = pytest.mark.slow


class Worker:
    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> str:
        return "pong"

    def block(self, seconds: float) -> int:
        time.sleep(seconds)      # stands in for a rank blocked in a collective its dead peer never joins
        return 1


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _pg_states(ray, pgs) -> set[str]:
    table = ray.util.placement_group_table()
    return {table[pg.id.hex()]["state"] for pg in pgs}


def test_killed_actor_fails_the_group_cleanly(ray_here):
    ray = ray_here
    from rstar2_core.runtime.ray.placement import ActorGroup, bundle_strategy

    layout = layout_for(load_config("tiny"))  # one CPU bundle (2 CPUs - 1 for the driver)
    group = ActorGroup(layout, timeout_s=60, prefix="t-kill-")
    pgs = list(group.pgs)
    assert _pg_states(ray, pgs) == {"CREATED"}
    for i in range(2):
        group.spawn(f"w{i}", Worker, num_cpus=0, **bundle_strategy(group.pg(0), 0))
    assert group.call_all("ping") == ["pong", "pong"]
    pids = group.call_all("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # A crash, as on a GPU node: SIGKILL the worker process. Wait until it is gone before calling, since
    # a call submitted while the process is still alive would legitimately be answered (ray.kill is
    # asynchronous too, which made an earlier version of this test race).
    os.kill(pids[1], signal.SIGKILL)
    assert _gone(pids[1]), "SIGKILL did not end the actor process"
    with pytest.raises(ActorFailure) as ei:
        group.call_all("ping", timeout=60)
    err = ei.value
    assert err.actor == "w1" and isinstance(err, ConnectionError)
    assert "retry resumes" in str(err)
    assert group.actors == {} and group.pgs == []
    assert all(_gone(p) for p in pids), "an actor process survived the group shutdown"
    assert _pg_states(ray, pgs) == {"REMOVED"}


def test_pipeline_retry_rule_retries_actor_failures():
    assert retry.is_infrastructure_error(ActorFailure("engine-3", RuntimeError("died")))
    assert retry.is_infrastructure_error(PlacementTimeout("no GPUs"))


def test_every_actor_death_of_the_ray_backend_is_retried_by_the_pipeline():
    """One list of Ray's errors (runtime/ray/errors.py): what placement treats as an actor death is what the
    retry rule retries when such a death reaches a task unwrapped, with Ray's current class names."""
    import ray.exceptions as rex

    from rstar2_core.runtime.ray import placement
    from rstar2_core.runtime.ray.errors import ray_actor_deaths, ray_infra_errors
    from tasks import retry

    assert placement._ACTOR_DEATHS == ray_actor_deaths() and rex.RayActorError in ray_actor_deaths()
    assert set(ray_actor_deaths()) < set(ray_infra_errors())
    for cls in ray_infra_errors():
        assert retry.is_infrastructure_error(cls.__new__(cls)), cls


def test_a_class_named_by_a_remote_traceback_is_never_imported(tmp_path, monkeypatch):
    """The constructor's traceback is another process's text: the exception class it names is looked up
    among the builtins and the modules already imported here, never imported (that would run the module's
    code in the driver, and a module whose import fails would replace the death being reported)."""
    import sys
    from types import SimpleNamespace

    from rstar2_core.runtime.ray.placement import creation_config_error

    (tmp_path / "rstar2_remote_only.py").write_text(
        "import os\nos.environ['RSTAR2_REMOTE_ONLY_RAN'] = '1'\nraise RuntimeError('no GPU driver here')\n"
        "class BadArgs(ValueError):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RSTAR2_REMOTE_ONLY_RAN", raising=False)

    def death(last_line):
        return SimpleNamespace(actor_init_failed=True, error_msg=(
            'Traceback (most recent call last):\n  File "/w/engine.py", line 9, in __init__\n    raise\n' + last_line))

    assert creation_config_error(death("rstar2_remote_only.BadArgs: tensor_parallel_size 3")) is None   # a real death
    assert "rstar2_remote_only" not in sys.modules and "RSTAR2_REMOTE_ONLY_RAN" not in os.environ
    assert creation_config_error(death("no_such_pkg.Error: x")) is None
    assert creation_config_error(death("ValueError: bad")) == "ValueError: bad"
    layout_error = "rstar2_core.runtime.layout.LayoutError: set rollout.num_engines = 32"
    assert creation_config_error(death(layout_error)) == layout_error


def _live_groups(ray) -> set:
    return {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}


def test_a_layout_no_node_can_hold_fails_at_once_naming_what_each_node_lacks(local_ray):
    ray = local_ray
    from rstar2_core.runtime.ray.placement import create_placement_groups

    layout = layout_for(load_config("tiny", ["cluster.cpus_per_node=64"]))  # 63 sandbox CPUs on a 2-CPU Ray
    before = _live_groups(ray)
    with pytest.raises(LayoutDoesNotFit, match="rstar2-node0 needs 63 CPU on one node") as ei:
        create_placement_groups(layout, timeout_s=600.0, prefix="t-nofit-")
    assert "head) lacks 61 CPU" in str(ei.value) and "rstar2 plan" in str(ei.value)
    assert retry.is_infrastructure_error(ei.value)          # a node coming back makes the retry fit
    assert _live_groups(ray) <= before                      # nothing was created


def test_a_layout_that_fits_but_not_now_times_out_and_frees_every_group(local_ray):
    """Two groups of 1 CPU fit the 2-CPU node, but another holder keeps one CPU: the gang is not placed
    in time, and the group that was placed is removed with the one that was not."""
    ray = local_ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rstar2_core.runtime.ray.placement import create_placement_groups

    layout = layout_for(load_config("tiny", ["cluster.nodes=2", "cluster.cpus_per_node=2",
                                                 "storage.shared_filesystem=true"]))
    assert [pg.cpus for pg in layout.placement_groups] == [1, 1]
    blocker = placement_group([{"CPU": 1}], name="t-blocker")
    ray.get(blocker.ready(), timeout=60)
    try:
        before = _live_groups(ray)
        with pytest.raises(PlacementTimeout, match="not scheduled within 2 s") as ei:
            create_placement_groups(layout, timeout_s=2.0, prefix="t-timeout-")
        assert "CPU 0 free of 2" in str(ei.value) and retry.is_infrastructure_error(ei.value)
        time.sleep(0.5)
        assert _live_groups(ray) <= before                  # all or none: the placed group was removed too
    finally:
        remove_placement_group(blocker)


class _FailsToStart:
    def __init__(self, exc: BaseException):
        raise exc


@pytest.mark.parametrize("exc, config", [
    # vLLM's engine arguments refused while EngineActor builds its engine
    (ValueError("User-specified max_model_len (40960) is greater than the derived max_model_len (32768)\n"
                "(second line)"), True),
    (TypeError("__init__() got an unexpected keyword argument 'tp'"), True),
    (LayoutError("set rollout.num_engines = 32"), True),         # a ValueError subclass, module-qualified
    (ModuleNotFoundError("No module named 'vllm'"), True),         # the node's image lacks the package
    (RuntimeError("CUDA error: an illegal memory access"), False),  # not a config error: still retried
])
def test_constructor_config_errors_are_not_retried(ray_here, exc, config):
    from rstar2_core.runtime.ray.placement import ActorGroup

    group = ActorGroup(None)
    group.spawn("engine-0", Worker, num_cpus=0)
    h = group.spawn("engine-1", _FailsToStart, exc, num_cpus=0)
    with pytest.raises((ActorConfigError, ActorFailure)) as ei:
        group.get([group.actors["engine-0"].ping.remote(), h.__ray_ready__.remote()], ["engine-0", "engine-1"],
                  timeout=120)
    err = ei.value
    assert err.actor == "engine-1" and group.actors == {}
    if config:
        assert isinstance(err, ActorConfigError) and isinstance(err, ValueError)
        assert f"{type(exc).__name__}: {str(exc).splitlines()[0]}" in str(err)
        assert not retry.is_infrastructure_error(err)
    else:
        assert isinstance(err, ActorFailure) and retry.is_infrastructure_error(err)


def _slow_engine(i):
    def make():
        if i == 1:
            time.sleep(120)      # engine 1 never finishes building within the test's timeout
        return object()
    return make


def test_engines_not_ready_in_time_raise_a_retryable_error_naming_them(ray_here):
    """The colocated hang of cluster.cpus_per_gpu = 1: a trainer shard holds the bundle's only CPU, so
    the engine actor asking 1 CPU of the same bundle is never scheduled; the readiness wait gives up after
    its timeout, names the engine and shuts the group down. A second engine still constructing is named
    too (which ones a wait names: test_the_readiness_wait_names_only_the_actors_not_ready)."""
    from rstar2_core.runtime.layout import Bundle, ClusterLayout, EngineSlot, PlacementGroupSpec
    from rstar2_core.runtime.ray.engine_actors import start_engines
    from rstar2_core.runtime.ray.placement import ActorGroup, bundle_strategy

    layout = ClusterLayout("colocated", 1, 0, 2, (PlacementGroupSpec("t-ready", 0, (Bundle(0, 1, "gpu"),)),),
                           (EngineSlot(0, 0, (), 1, 0.0), EngineSlot(1, 0, (), 1, 0.0), EngineSlot(2, 0, (0,), 1, 0.0)),
                           (), ())
    group = ActorGroup(layout, timeout_s=60, prefix="t-ready-")
    pgs = list(group.pgs)
    group.spawn("trainer-0", Worker, num_cpus=1, **bundle_strategy(group.pg(0), 0))   # takes the bundle's CPU
    assert group.call_all("ping") == ["pong"]
    t0 = time.monotonic()
    with pytest.raises(ActorStartTimeout) as ei:   # 15 s: room for an actor process to start on a loaded machine
        start_engines(group, layout, factory=_slow_engine, ready_timeout_s=15)
    assert time.monotonic() - t0 < 60
    err = ei.value   # engine-0 starts at once, but on a loaded machine its process may take longer than 15 s
    assert err.actors[-2:] == ["engine-1", "engine-2"] and set(err.actors) <= {"engine-0", "engine-1", "engine-2"}
    assert "cluster.placement_timeout_s" in str(err)
    assert retry.is_infrastructure_error(err)
    assert group.actors == {} and group.pgs == [] and _pg_states(ray_here, pgs) == {"REMOVED"}


def test_trainer_shards_not_placed_in_time_raise_a_retryable_error(ray_here):
    """A shard Ray cannot place (here: half a GPU on a CPU-only Ray) fails the trainer's start after the
    timeout instead of blocking the rendezvous forever."""
    from rstar2_core.runtime.layout import ClusterLayout, TrainerShard
    from rstar2_core.runtime.ray.placement import ActorGroup
    from rstar2_core.runtime.ray.trainer_shards import TrainerGroup

    layout = ClusterLayout("colocated", 1, 0, 2, (), (), (TrainerShard(0, 0, -1, 0.0), TrainerShard(1, 0, -1, 0.5)),
                           ())
    group = ActorGroup(None)
    with pytest.raises(ActorStartTimeout, match=r"trainer shards (trainer-0, )?trainer-1 not ready within 15 s") as ei:
        TrainerGroup(group, layout, dict, {}, None, ready_timeout_s=15)   # trainer-0: late only on a loaded machine
    assert ei.value.actors[-1] == "trainer-1" and group.actors == {}


def test_the_readiness_wait_names_only_the_actors_not_ready(ray_here):
    """An actor constructed before the wait is never named; one Ray cannot place (half a GPU on a CPU-only
    Ray) is, after the timeout, and the group is shut down."""
    from rstar2_core.runtime.ray.placement import ActorGroup

    group = ActorGroup(None)
    group.spawn("ready", Worker, num_cpus=0)
    assert group.call_all("ping", timeout=300) == ["pong"]        # constructed: its __ray_ready__ answers at once
    group.spawn("unplaceable", Worker, num_cpus=0, num_gpus=0.5)
    with pytest.raises(ActorStartTimeout, match="actors unplaceable not ready within 10 s") as ei:
        group.wait_ready(["ready", "unplaceable"], 10)
    assert ei.value.actors == ["unplaceable"] and group.actors == {}


def test_a_blocked_live_rank_is_not_blamed_for_its_dead_peer(ray_here, kill_and_wait):
    """Under NCCL the surviving rank sits in the collective its dead peer never joins and cannot answer
    `__ray_ready__`: the failure names the dead rank, not the first busy one."""
    from rstar2_core.runtime.ray.placement import ActorGroup

    group = ActorGroup(None)
    for i in range(2):
        group.spawn(f"trainer-{i}", Worker, num_cpus=0)
    assert group.call_all("ping") == ["pong", "pong"]
    blocked = group.actors["trainer-0"].block.remote(120)
    kill_and_wait(ray_here, group.actors["trainer-1"])
    t0 = time.monotonic()
    with pytest.raises(ActorFailure) as ei:
        group.get([blocked, group.actors["trainer-1"].ping.remote()], ["trainer-0", "trainer-1"], timeout=60)
    assert ei.value.actor == "trainer-1"
    assert time.monotonic() - t0 < 30 and group.actors == {}


def test_only_an_unreachable_actor_or_a_dead_node_waits_for_the_nodes_verdict():
    import ray.exceptions as rex

    from rstar2_core.runtime.ray.placement import may_be_node_loss

    assert may_be_node_loss(rex.ActorUnavailableError("RpcError: Socket closed", None))
    assert may_be_node_loss(rex.ActorDiedError()) is False             # a plain death: checked once
    died = rex.ActorDiedError()
    died.error_msg = "The actor died because its node has died. Node Id: 5c3a"
    assert may_be_node_loss(died)
    oom = rex.ActorDiedError()
    oom.error_msg = "1 worker(s) were killed due to the node running low on memory"
    assert not may_be_node_loss(oom)
    init = rex.ActorDiedError()
    init._actor_init_failed, init.error_msg = True, "ValueError: its node has died (a constructor's words)"
    assert not may_be_node_loss(init)


def test_the_wait_for_a_nodes_death_verdict_is_the_groups_setting(monkeypatch):
    """`cluster.node_death_wait_s` bounds how long a failure that looks like a node loss waits for Ray's
    verdict (the RayRuntime builds its group with it); any other death is checked once, without waiting."""
    import ray.exceptions as rex

    from rstar2_core.runtime.ray import placement

    waits: list[float] = []
    monkeypatch.setattr(placement, "_dead_nodes", lambda ids, wait_s: waits.append(wait_s) or {})
    for death, expected in ((rex.ActorUnavailableError("RpcError: Socket closed", None), 7.5),
                            (rex.ActorDiedError(), 0.0)):
        group = placement.ActorGroup(None, node_death_wait_s=7.5)
        group.nodes = {"engine-0": "a" * 56}
        assert isinstance(group.failure("engine-0", death), ActorFailure)
        assert waits[-1] == expected
    assert load_config("tiny").cluster.node_death_wait_s == placement.NODE_DEATH_WAIT_S == 60.0
    assert load_config("tiny", ["cluster.node_death_wait_s=5"]).cluster.node_death_wait_s == 5.0


def test_two_threads_failing_one_group_get_one_error_and_one_shutdown():
    """A pipelined stage's update thread and its event loop can both see the same loss: the group is shut
    down once, and both raise the first caller's error (no dict changed while iterated)."""
    import threading

    from rstar2_core.runtime.ray.placement import ActorGroup

    group = ActorGroup(None)
    group.nodes = {"engine-0": "a" * 56, "trainer-0": "b" * 56}
    out: list = []
    threads = [threading.Thread(target=lambda n=n: out.append(group.failure(n, RuntimeError("died"))))
               for n in ("engine-0", "trainer-0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 2 and out[0] is out[1] and isinstance(out[0], ActorFailure)
    assert group.actors == {} and group.nodes == {}


def test_a_runtime_holding_the_slot_removes_the_groups_a_killed_runtime_left(local_ray):
    """A stage task OOM-killed mid-step leaves its `rt-*` groups (they live as long as the job): the retry
    holding the runtime slot removes them instead of waiting for its own gang; its own groups, groups of
    other names and a process without the slot leave them alone (found by the production rehearsal)."""
    ray = local_ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from rstar2_core.runtime.ray.connect import holds_runtime_slot
    from rstar2_core.runtime.ray.placement import remove_stale_runtime_groups

    left = placement_group([{"CPU": 1}], name="rt-dead01-rstar2-node0")
    other = placement_group([{"CPU": 0.1}], name="t-other")
    ray.get([left.ready(), other.ready()], timeout=60)
    try:
        assert not holds_runtime_slot()                          # the driver holds no slot: nothing removed
        assert remove_stale_runtime_groups("rt-new002-", holds_runtime_slot()) == []
        assert remove_stale_runtime_groups("rt-dead01-", holds_slot=True) == []      # its own groups
        assert remove_stale_runtime_groups("rt-new002-", holds_slot=True) == ["rt-dead01-rstar2-node0"]
        states = {v["name"]: v["state"] for v in placement_group_table().values()}
        assert states["rt-dead01-rstar2-node0"] == "REMOVED" and states["t-other"] == "CREATED"
    finally:
        remove_placement_group(other)
