"""The template's pipelined spawns (confined/sbx_calls.py `_spawn`, `_on_zygote`), driven in this process with a
fake zygote: the template sends a call's spec and goes on; the answers come as events, in order. Covered
here because a real zygote refuses a clone only when the host runs out of processes: a refused clone
fails that call alone, an answer out of order stops the template, a kill asked for before the pid
is known is carried out when it arrives."""

from __future__ import annotations

import collections
import importlib.util
import os
import pickle
import struct
import subprocess
from types import SimpleNamespace

import pytest

from rstar2_core.sandbox.dispatcher import TEMPLATE_PATH


def _template_module():
    spec = importlib.util.spec_from_file_location("sbx_template_under_test", TEMPLATE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _template_module()


class FakeZygote:
    """Records the specs sent (keeping its own copies of the fds, as the socket message does) and
    answers what the test queues."""

    def __init__(self):
        self.sent: list[tuple[dict, list[int]]] = []
        self.replies: collections.deque[dict] = collections.deque()

    def send(self, spec: dict, fds: list[int]) -> None:
        self.sent.append((spec, [os.dup(fd) for fd in fds]))

    def reply(self):
        return self.replies.popleft() if self.replies else None


@pytest.fixture()
def tpl(tmp_path):
    ctrl_in_r, ctrl_in_w = os.pipe()
    out_r, out_w = os.pipe()
    os.set_blocking(out_r, False)
    t = T.Template({"ctrl_in": ctrl_in_r, "ctrl_out": out_w, "slots": 2, "kind": "light", "workdir": str(tmp_path)})
    t.cs = SimpleNamespace(conf={"tmp_opts": None})
    t.uids, t.feats, t.zygote = None, {"pidns": False}, FakeZygote()
    t.devnull = os.open(os.devnull, os.O_RDONLY)
    t.results = out_r
    yield t
    for _, fds in t.zygote.sent:
        for fd in fds:
            os.close(fd)
    for call in [*t.cloning, *t.calls.values()]:
        for fd in list(call.open_fds):
            t._close_fd(call, fd)
    for fd in (ctrl_in_r, ctrl_in_w, out_r, out_w, t.devnull):
        os.close(fd)


def request(cid: int) -> dict:
    return {"cid": cid, "code": "print(1)", "stdin": "", "timeout_s": 5.0, "cpu_s": 5.0, "memory_mb": 256,
            "nproc": 16, "fsize_mb": 8, "max_chars": 1000, "mode": "truncate", "drain_bytes": 1 << 20}


def results(t) -> list[dict]:
    buf = os.read(t.results, 1 << 20)
    out = []
    while buf:
        (n,) = struct.unpack(">I", buf[:4])
        out.append(pickle.loads(buf[4:4 + n]))
        buf = buf[4 + n:]
    return out


def test_the_template_sends_without_waiting_and_a_refused_clone_fails_only_its_call(tpl):
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        tpl._spawn(request(1))
        tpl._spawn(request(2))
        assert [s["slot"] for s, _ in tpl.zygote.sent] == [0, 1] and len(tpl.cloning) == 2 and not tpl.free_slots
        first, second = tpl.cloning
        assert first.pid is None and first.open_fds   # its output and code pipes are live before the clone
        tpl.zygote.replies += [{"slot": 0, "errno": 11, "error": "Resource temporarily unavailable", "nsfd": -1},
                               {"slot": 1, "pid": sleeper.pid, "nsfd": -1}]
        tpl._on_zygote()
        (res,) = results(tpl)
        assert res["cid"] == 1 and res["status"] == "internal"
        assert res["stderr"] == "sandbox could not start the program: [Errno 11] Resource temporarily unavailable"
        assert not first.open_fds and tpl.free_slots == [0] and not tpl.cloning
        assert tpl.calls == {sleeper.pid: second} and second.pidfd in second.open_fds
        assert not any(owner is first for owner, _ in tpl.fd_owner.values())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_answer_out_of_order_stops_the_template(tpl):
    tpl._spawn(request(1))
    tpl.zygote.replies.append({"slot": 1, "pid": os.getpid(), "nsfd": -1})   # slot 0 was sent
    with pytest.raises(RuntimeError, match="the sandbox zygote died: answer for slot 1 out of order"):
        tpl._on_zygote()


def test_a_kill_asked_for_before_the_pid_is_carried_out_when_it_comes(tpl):
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        tpl._spawn(request(1))
        (call,) = tpl.cloning
        tpl._kill(call, "output")     # e.g. an output flood read before the zygote's answer
        assert call.kill_reason == "output" and sleeper.poll() is None
        tpl.zygote.replies.append({"slot": 0, "pid": sleeper.pid, "nsfd": -1})
        tpl._on_zygote()
        assert sleeper.wait(timeout=10) == -9 and tpl.calls[sleeper.pid] is call
    finally:
        sleeper.kill()
        sleeper.wait()
