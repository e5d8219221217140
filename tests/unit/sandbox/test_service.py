"""The service around the templates: restart after a template dies, clean shutdown, output modes,
the JSONL contract of `rstar2 sandbox run`."""

from __future__ import annotations

import gc
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from rstar2_core.sandbox import ExecutionRequest, LocalSandbox, SandboxError, Status
from rstar2_core.sandbox.jsonl import run_jsonl

ROOT = Path(__file__).resolve().parents[3]


def _pids(box) -> set[int]:
    return {t.proc.pid for ts in box._d.templates.values() for t in ts}


def _alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.add(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _children(pid: int) -> int:
    try:
        return len(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return 0


def _kill_template_when_busy(box, times: int) -> threading.Thread:
    """SIGKILL a template `times` times, each once a call runs in it: the template has the request
    (`inflight`) and one child more than an idle template (the call's, beside its zygote and helpers).
    Call before any request: the box's templates are idle then."""
    idle = {_children(t.proc.pid) for t in box._d.templates["light"]}
    assert len(idle) == 1 and idle != {0}, idle        # every idle template has the same children
    idle_children = idle.pop()
    killed: set[int] = set()

    def killer():
        for _ in range(times):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                running = [t for t in box._d.templates["light"] if t.inflight and t.hello and not t.dead
                           and t.proc.pid not in killed and _children(t.proc.pid) > idle_children]
                if running:
                    killed.add(running[0].proc.pid)
                    os.kill(running[0].proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.01)

    th = threading.Thread(target=killer)
    th.start()
    return th


def test_template_death_is_retried_once_on_a_fresh_template(make_cfg):
    with LocalSandbox(make_cfg(preload=["math"], workers=1)) as box:
        old = _pids(box)
        th = _kill_template_when_busy(box, times=1)
        r = box.run_sync(ExecutionRequest(code="import time; time.sleep(0.6); print('done')", id="r"))
        th.join()
        assert (r.status, r.stdout, r.id) == (Status.OK, "done\n", "r")
        assert _pids(box) != old and box.stats()["sandbox/template_deaths"] == 1
        assert box.run_sync(ExecutionRequest(code="print(1)")).stdout == "1\n"


def test_template_dying_twice_answers_internal(make_cfg):
    with LocalSandbox(make_cfg(preload=["math"], workers=1)) as box:
        th = _kill_template_when_busy(box, times=2)
        r = box.run_sync(ExecutionRequest(code="import time; time.sleep(1.0)", id="r"))
        th.join()
        assert r.status is Status.INTERNAL and "died" in r.stderr and r.id == "r"
        assert box.run_sync(ExecutionRequest(code="print(2)")).stdout == "2\n"


def test_a_dead_zygote_takes_its_template_down_and_the_call_is_retried(make_cfg):
    """Every call's child is cloned by the template's zygote (docs/sandbox.md): when the zygote dies the
    template exits, the dispatcher starts a fresh one (with its own zygote) and runs the call there."""
    with LocalSandbox(make_cfg(preload=["math"], workers=1)) as box:
        zygote = box._d.templates["light"][0].hello["zygote_pid"]
        os.kill(zygote, signal.SIGKILL)
        r = box.run_sync(ExecutionRequest(code="print(6 * 7)", id="r"))
        assert (r.status, r.stdout) == (Status.OK, "42\n"), r
        fresh = box._d.templates["light"][0].hello["zygote_pid"]
        assert fresh != zygote and box.stats()["sandbox/template_deaths"] == 1
    deadline = time.monotonic() + 10
    while _alive({fresh}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive({fresh}), "close() left the zygote running"


def test_an_idle_template_whose_zygote_dies_is_restarted_before_the_next_call(make_cfg):
    """An idle template watches its zygote's socket: when the zygote dies, the template exits at once
    (before, it reported healthy until its next call) and the dispatcher starts a fresh one, which
    then runs the next call with no further restart."""
    with LocalSandbox(make_cfg(preload=["math"], workers=1)) as box:
        old = box._d.templates["light"][0]
        os.kill(old.hello["zygote_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            fresh = box._d.templates["light"][0]
            if fresh is not old and fresh.hello:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the template did not notice that its zygote died")
        assert old.dead and old.proc.returncode == 1, old.proc.returncode   # it stopped on the error
        assert fresh.hello["zygote_pid"] != old.hello["zygote_pid"]
        r = box.run_sync(ExecutionRequest(code="print(6 * 7)", id="r"))
        assert (r.status, r.stdout) == (Status.OK, "42\n"), r
        assert box.stats()["sandbox/template_deaths"] == 1 and box.stats()["sandbox/template_starts"] == 2


def test_close_and_garbage_collection_stop_every_process(make_cfg):
    box = LocalSandbox(make_cfg(preload=["math"])).start()
    pids, workdir = _pids(box), box._d.workdir
    box.run_sync(ExecutionRequest(code="import time; time.sleep(0.1)"))
    box.close()
    assert not _alive(pids) and not os.path.exists(workdir)
    with pytest.raises(SandboxError, match="closed"):
        box.run_sync(ExecutionRequest(code="1"))

    box = LocalSandbox(make_cfg(preload=["math"])).start()
    pids = _pids(box)
    del box
    gc.collect()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids)


def test_close_answers_queued_calls_internal(make_cfg):
    box = LocalSandbox(make_cfg(preload=["math"], workers=1)).start()
    results = []
    for i in range(5):
        box.submit(ExecutionRequest(code="import time; time.sleep(0.3)", id=str(i)), results.append)
    time.sleep(0.1)
    box.close()
    assert sorted(r.id for r in results) == [str(i) for i in range(5)]
    assert any(r.status is Status.INTERNAL for r in results)


def test_reject_mode_reports_output_limit(make_cfg):
    with LocalSandbox(make_cfg(preload=["math"], output_mode="reject", max_output_chars=10)) as box:
        r = box.run_sync(ExecutionRequest(code="print('a' * 11)"))
        assert (r.status, r.stdout, r.truncated) == (Status.OUTPUT_LIMIT, "a" * 10, True)
        assert box.run_sync(ExecutionRequest(code="print('a' * 9)")).status is Status.OK


def test_garbage_request_lines_get_invalid_request_in_order(light_only):
    lines = ['{"id": "a", "code": "print(1)"}', "not json", "", '[1, 2]', '{"id": "b"}',
             '{"id": 7, "code": "input()", "stdin": "x\\n"}', '{"id": "c", "code": "1", "stdin": 5}', '{"code": "3"}']
    out = io.StringIO()
    counts = run_jsonl(light_only, iter([ln + "\n" for ln in lines]), out)
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["id"] for r in rows] == ["a", None, None, "b", 7, "c", None]
    assert [r["status"] for r in rows] == ["ok", "invalid_request", "invalid_request", "invalid_request", "ok",
                                           "invalid_request", "ok"]
    assert rows[4]["stdout"] == "'x'\n" and rows[6]["stdout"] == "3\n"
    assert counts == {"ok": 3, "invalid_request": 4}
    assert set(rows[0]) == {"id", "status", "stdout", "stderr", "exit_code", "duration_s", "truncated", "cpu_s"}


@pytest.mark.slow
def test_cli_run_contract():
    reqs = ['{"id": "1", "code": "print(6 * 7)"}', "garbage", '{"id": "2", "code": "while True: pass"}',
            '{"id": "3", "code": "import os; print(os.environ.get(\'RSTAR2_HOME\'))"}']
    env = {**os.environ, "RSTAR2_HOME": str(ROOT / ".rstar2" / "test")}
    p = subprocess.run([sys.executable, "-m", "rstar2_cli.main", "sandbox", "run", "--workers", "2", "--timeout-s", "1",
                        "--memory-mb", "256", "--set", "sandbox.preload=[\"math\"]"],
                       input="\n".join(reqs) + "\n", capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(r["id"], r["status"]) for r in rows] == [("1", "ok"), (None, "invalid_request"), ("2", "timeout"), ("3", "ok")]
    assert rows[0]["stdout"] == "42\n" and rows[0]["exit_code"] == 0 and rows[0]["truncated"] is False
    assert rows[2]["exit_code"] is None and rows[2]["duration_s"] >= 0.9     # killed at the limit, not before
    assert rows[3]["stdout"] == "None\n"
    bad = subprocess.run([sys.executable, "-m", "rstar2_cli.main", "sandbox", "run", "--timeout-s", "-1"],
                         input="", capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=False)
    assert bad.returncode != 0 and "timeout_s" in bad.stderr


def test_a_result_carries_the_programs_cpu_seconds():
    """`cpu_s` is the program's user + system CPU (from the child's rusage), what the RL step sums as
    `usage/sandbox_cpu_s`: a busy loop shows its CPU, a sleep shows almost none."""
    from rstar2_core.config import SandboxConfig

    with LocalSandbox(SandboxConfig(workers=1)) as box:
        busy = box.run_sync(ExecutionRequest(code="x = 0\nfor i in range(3_000_000):\n    x += i\nprint(x > 0)"))
        idle = box.run_sync(ExecutionRequest(code="import time\ntime.sleep(0.3)\nprint(1)"))
    assert busy.status is Status.OK and idle.status is Status.OK
    assert busy.cpu_s is not None and 0.05 < busy.cpu_s <= busy.duration_s + 0.05
    assert idle.cpu_s is not None and idle.cpu_s < 0.15 < idle.duration_s
