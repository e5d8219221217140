"""Test-session set-up: local state under .rstar2/test (never ~), a check that the session leaves no
stray child processes behind, no skips but for hardware (a skip whose reason names no GPU, CUDA or CPU
architecture is reported as a failure: after `make setup` everything else this suite needs is here, so
any other skip would be a check that silently did not run), and the toy policy the RL stage tests share (`toy_policy.py`: a tiny
Qwen2 model SFT-ed in a few seconds of CPU to call the Python tool with `print(1)` or `print(2)`,
sometimes a misspelt `pritn` first, then answer with what it printed; on problems whose gold answer is
1 some rollouts are right, so GRPO groups have signal)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["sigterm_teardown"]
_STATE = Path(os.environ.get("RSTAR2_HOME", ROOT / ".rstar2")) / "test"
for _k, _v in {
    "RSTAR2_HOME": str(_STATE),
    "XDG_CACHE_HOME": str(ROOT / ".rstar2" / "cache"),
    "HF_HOME": str(ROOT / ".rstar2" / "cache" / "huggingface"),
    "HF_HUB_OFFLINE": "1",
    "MPLCONFIGDIR": str(ROOT / ".rstar2" / "cache" / "matplotlib"),
    "PREFECT_HOME": str(_STATE / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ[_k] = _v
_STATE.mkdir(parents=True, exist_ok=True)


# The only reasons a test may skip: hardware this machine lacks (a GPU, CUDA) or its CPU architecture.
# Case-sensitive, so that a package or path that merely contains "gpu" does not pass for one.
HARDWARE_SKIP = re.compile(r"\b(needs?|no|without|on) (a |an )?(GPU|CUDA)\b|\b(CPU|machine) architecture\b|"
                           r"\b(x86_64|x32|aarch64|arm64)\b")


def _skip_reason(longrepr) -> str:
    text = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    return text.removeprefix("Skipped: ")


def _no_silent_skip(report) -> None:
    """Turn `report` (a test phase's or a module's collection) into a failure when it skipped for a reason
    outside HARDWARE_SKIP, naming the test and the reason."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    if HARDWARE_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"{report.nodeid} skipped ({reason}), and only hardware may skip a test here (the reason "
                       f"must name a GPU, CUDA or the CPU architecture: tests/conftest.py HARDWARE_SKIP). "
                       f"Install what it needs (make setup) or make it fail with that message.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _no_silent_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _no_silent_skip(outcome.get_result())


_FOLDER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum each phase's seconds (set-up, call, tear-down) by the test file's folder."""
    folder = report.nodeid.split("::", 1)[0].rsplit("/", 1)[0]
    _FOLDER_SECONDS[folder] = _FOLDER_SECONDS.get(folder, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The suite's seconds by folder, slowest first (docs/measurements.md compares them across runs). A
    session-scoped fixture's set-up counts in the folder of the first test that asked for it."""
    if not _FOLDER_SECONDS:
        return
    total = sum(_FOLDER_SECONDS.values())
    terminalreporter.section("seconds by folder")
    for folder, sec in sorted(_FOLDER_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{sec:8.1f} s  {100 * sec / total:5.1f}%  {folder}")
    terminalreporter.write_line(f"{total:8.1f} s  total of the tests' phases")


def _children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker: one per interpreter, started by
    the first spawned process (vLLM's engine) and ending with the interpreter, not a leak."""
    try:
        import psutil
    except ImportError:
        return set()
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            pass
        out.add(p.pid)
    return out


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    before = _children()
    yield
    import time

    import psutil

    deadline = time.time() + 10
    left: set[int] = set()
    while time.time() < deadline:
        left = set()
        for pid in _children() - before:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.add(pid)
            except psutil.NoSuchProcess:
                pass
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"test session left processes behind: {sorted(left)}"


@pytest.fixture(scope="session")
def toy_policy(tmp_path_factory):
    """(checkpoint_url, data_url, final SFT loss) of the SFT-ed toy policy and a 12-problem RL set (gold 1)."""
    import torch
    from toy_policy import build_toy_policy

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only add contention at these sizes
    try:
        return build_toy_policy(tmp_path_factory.mktemp("toy_policy"))
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def dist_env():
    """One single-rank gloo group (env://) for the whole session: DeepSpeed caches its process groups, so a
    group destroyed after one module and created again for the next leaves it holding a dead one."""
    import socket

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp = pytest.MonkeyPatch()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        mp.setenv(k, v)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    mp.undo()


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray (tests/ray_local.py) shared by the tests that need one (the cluster tests, the vLLM engine
    actors); stopped at the end of the session, its temp folder removed."""
    import ray
    from ray_local import local_ray_session

    with local_ray_session("cl"):
        yield ray


@pytest.fixture
def s3_endpoint(monkeypatch):
    """A moto S3 server on 127.0.0.1 (a thread of this process) that `storage` is configured for."""
    from moto.server import ThreadedMotoServer

    from rstar2_core import storage

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    storage.configure_s3(endpoint, "us-east-1")
    try:
        yield endpoint
    finally:
        storage.configure_s3(None, None)
        server.stop()
