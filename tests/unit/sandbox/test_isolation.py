"""One adversarial property per test (docs/sandbox-isolation.md lists what is and is not isolated)."""

from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import pytest

from rstar2_core.sandbox import ExecutionRequest, LocalSandbox, Status


def run(sb, code: str, stdin: str = ""):
    return sb.run_sync(ExecutionRequest(code=code, stdin=stdin))


def _template_pids(sb) -> set[int]:
    return {t.proc.pid for ts in sb._d.templates.values() for t in ts}


def _by_name(name: str) -> set[int]:
    out = set()
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == name:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.add(p.pid)
            except psutil.NoSuchProcess:
                pass
    return out


_SPAWN_TREE = """
import ctypes, os, time
def mark():
    ctypes.CDLL(None).prctl(15, b"{name}", 0, 0, 0)   # PR_SET_NAME: visible on the host
if os.fork() == 0:                     # a child
    mark(); time.sleep(1000)
if os.fork() == 0:                     # a double-forked daemon in its own session
    os.setsid()
    if os.fork() == 0:
        mark(); time.sleep(1000)
    os._exit(0)
mark()
while True:
    pass
"""


# the program, its child and the daemon all run a while before the program ends by itself
_SPAWN_TREE_ENDING = _SPAWN_TREE.replace("while True:\n    pass", "time.sleep(1.0)")


def _run_watched(sb, code: str, name: str):
    """(result, PIDs of the processes named `name` seen while `code` ran): the processes a check that they
    are gone must first have seen."""
    seen: set[int] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(_by_name(name))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        r = run(sb, code)
    finally:
        done.set()
        w.join()
    assert len(seen) >= 3, f"the program's processes (itself, a child, a daemon) were not observed: {seen}"
    return r, seen


def _left(name: str, timeout_s: float = 2.0) -> set[int]:
    """The processes named `name` still running once none is, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while (left := _by_name(name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_timeout_kills_children_and_grandchildren(sb):
    name = f"rsbx{os.getpid() % 100000}"
    r, seen = _run_watched(sb, _SPAWN_TREE.format(name=name), name)
    assert r.status is Status.TIMEOUT and r.exit_code is None
    assert not (_left(name) & seen), "a process of the timed-out program survived"


def test_background_processes_die_when_the_program_ends(sb):
    name = f"rsbg{os.getpid() % 100000}"
    r, _ = _run_watched(sb, _SPAWN_TREE_ENDING.format(name=name), name)
    assert r.status is Status.OK
    assert not _left(name)


def test_memory_bomb_reports_memory(sb):
    r = run(sb, "x = bytearray(2 * 1024**3)")
    assert r.status is Status.MEMORY and "MemoryError" in r.stderr
    r = run(sb, "a = []\nwhile True:\n    a.append(' ' * (32 << 20))")  # growth until the limit
    assert r.status is Status.MEMORY


def test_fork_bomb_is_contained_and_the_next_call_is_fine(sb):
    before = len(psutil.pids())
    peak = [before]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(psutil.pids()))
            time.sleep(0.02)

    w = threading.Thread(target=watch)
    w.start()
    r = run(sb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    done.set()
    w.join()
    assert r.status is Status.TIMEOUT
    assert peak[0] - before <= sb.cfg.max_processes + 20, f"{peak[0] - before} processes appeared"
    deadline = time.monotonic() + 60           # the bomb's tree goes with it (a bound that only catches a leak)
    while len(psutil.pids()) - before > 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(psutil.pids()) - before <= 20, f"{len(psutil.pids()) - before} processes outlived the fork bomb"
    assert run(sb, "print('fine')").stdout == "fine\n"


def test_huge_print_is_capped_without_memory_blowup(sb):
    tpl = psutil.Process(sb._d.templates["light"][0].proc.pid)
    rss0 = tpl.memory_info().rss
    r = run(sb, "print('x' * 10_000_000)")
    assert r.status is Status.OK and r.truncated
    assert r.stdout == "x" * sb.cfg.max_output_chars
    assert tpl.memory_info().rss - rss0 < 8 << 20
    r = run(sb, "while True:\n    print('y' * 100000)")  # a flood: killed at the drain limit, not at timeout
    assert r.status is Status.OUTPUT_LIMIT and r.truncated


def test_killing_the_parent_does_not_hurt_the_service(sb):
    pids = _template_pids(sb)
    run(sb, "import os; os.kill(os.getppid(), 9)")
    run(sb, "import os, signal\nos.kill(-1, signal.SIGKILL)")   # everything it can reach
    run(sb, "import os\nfor p in range(2, 4096):\n    try:\n        os.kill(p, 9)\n    except OSError:\n        pass")
    assert _template_pids(sb) == pids and all(psutil.pid_exists(p) for p in pids)
    assert run(sb, "print(7)").stdout == "7\n"
    assert os.getpid() == psutil.Process().pid  # and we are still here


def test_no_network(sb):
    if not sb.features["light"]["features"]["netns"]:
        pytest.fail("this host forbids network namespaces, so `no_network` is unchecked (see `rstar2 sandbox doctor`)",
                    pytrace=False)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        probe = socket.create_connection(("127.0.0.1", port), timeout=2)  # reachable from the host
        probe.close()
        r = run(sb, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
    finally:
        srv.close()
    assert r.status is Status.ERROR and "connected" not in r.stdout
    assert "Error" in r.stderr


def test_parent_environment_is_invisible(make_cfg):
    os.environ["RSTAR2_TEST_SECRET"] = "hunter2"
    try:
        with LocalSandbox(make_cfg(preload=["math"])) as box:
            r = run(box, "import os\nprint(sorted(os.environ))\nprint('hunter2' in str(os.environ))")
    finally:
        del os.environ["RSTAR2_TEST_SECRET"]
    assert r.status is Status.OK and "RSTAR2_TEST_SECRET" not in r.stdout and r.stdout.endswith("False\n")


def test_no_state_leaks_between_calls(light_only):
    first = ("import math, builtins, os\nmath.leak = 1\nbuiltins.leak = 2\nos.environ['LEAK'] = '3'\n"
             "open('leak.txt', 'w').write('x')\nLEAK = 4")
    assert run(light_only, first).status is Status.OK
    r = run(light_only, "import math, builtins, os\n"
                        "print(hasattr(math, 'leak'), hasattr(builtins, 'leak'), 'LEAK' in os.environ,\n"
                        "      os.path.exists('leak.txt'), 'LEAK' in globals())")
    assert r.stdout == "False False False False False\n"


def test_files_written_go_away(light_only):
    r = run(light_only, "import os\nos.makedirs('d/e')\nopen('d/e/f.txt', 'w').write('x' * 1000)\nprint(os.getcwd())")
    cwd = r.stdout.strip()
    assert r.status is Status.OK
    if light_only.features["light"]["features"]["private_tmp"]:
        assert cwd == "/tmp"   # the call's own tmpfs, gone with its mount namespace
    else:
        assert cwd.startswith(light_only._d.workdir) and not os.path.exists(cwd)
    # (a checkout or venv under /tmp is linked from every call's /tmp: links are not files a call left)
    r = run(light_only, "import os\nprint(os.path.exists('d'), [p for p in os.listdir('.') if not os.path.islink(p)])")
    assert r.stdout == "False []\n"
    r = run(light_only, "open('big', 'wb').write(b'x' * (80 << 20))")  # over RLIMIT_FSIZE (64 MiB)
    assert r.status is not Status.OK


def test_cannot_write_the_service_files(light_only):
    size = os.path.getsize(__file__)
    r = run(light_only, f"open({__file__!r}, 'a').write('# changed')")
    # PermissionError where the host's files are visible, FileNotFoundError in the minimal root
    assert r.status is Status.ERROR and ("PermissionError" in r.stderr or "FileNotFoundError" in r.stderr)
    assert os.path.getsize(__file__) == size


def test_without_namespaces_daemons_still_die(make_cfg):
    name = f"rsnn{os.getpid() % 100000}"
    lost = ["minimal_root", "private_tmp", "own_proc", "pid_namespace", "no_network", "private_abstract_sockets",
            "private_ipc"]
    with LocalSandbox(make_cfg(preload=["math"], namespaces=False, allow_missing_isolation=lost)) as box:
        f = box.features["light"]["features"]
        assert not f["pidns"] and not f["netns"]
        if not f["uid_drop"]:
            pytest.fail("not root: without namespaces a daemon that calls setsid can escape, and this test cannot "
                        "check the uid drop that stops it (docs/sandbox-isolation.md)", pytrace=False)
        r, _ = _run_watched(box, _SPAWN_TREE_ENDING.format(name=name), name)
        assert r.status is Status.OK
        assert not _left(name)
        r, _ = _run_watched(box, _SPAWN_TREE.format(name=name), name)
        assert r.status is Status.TIMEOUT
        assert not _left(name)
