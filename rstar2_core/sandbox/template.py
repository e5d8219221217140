"""The warm template process: imports the configured modules once, sets up its isolation, forks the
zygote, then serves the service's requests over its control pipes in one event loop; each call is
supervised by `CallSupervisor` (confined/sbx_calls.py).

Run only by the dispatcher as `python -I template.py '<json settings>'` (isolated mode: no PYTHON*
variables, no script directory on sys.path, so this package's `types.py` cannot shadow the standard
library in the user's program). Invariant: standard library only, never `rstar2_core`, and its helpers
in confined/ are imported by file location before the pivot into the minimal root; the zygote is
forked before the first request, so no call's child holds another call's code or output.
See docs/sandbox.md, "The template and its calls".
"""

from __future__ import annotations

import collections
import errno
import gc
import importlib
import json
import os
import selectors
import signal
import sys
import time

_CONFINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confined")
sys.path.insert(0, _CONFINED)   # only while importing our helpers (names no program would use)
import sbx_calls
import sbx_child as child
import sbx_frames as frames
import sbx_isolation as iso
import sbx_zygote as zygote

sys.path.remove(_CONFINED)

MAX_DEAD_NS = 1024   # finished calls' mount namespaces (their /tmp in RAM) waiting for the reaper


class Template(sbx_calls.CallSupervisor):
    def __init__(self, settings: dict):
        self.s = settings
        self.sel = selectors.EpollSelector()
        self.ctrl_in, self.ctrl_out = settings["ctrl_in"], settings["ctrl_out"]
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.calls: dict[int, sbx_calls._Call] = {}      # pid -> call
        self.fd_owner: dict[int, tuple[sbx_calls._Call, str]] = {}
        self.free_slots = list(range(int(settings["slots"])))[::-1]
        self.cloning: collections.deque[sbx_calls._Call] = collections.deque()  # sent to the zygote, no pid yet
        self.pending: collections.deque[dict] = collections.deque()  # waiting for a free slot
        self.stopping = False
        self.seq = 0
        self.dead_ns: list[int] = []   # mount namespaces of finished calls, for the reaper

    # -- start
    def start(self) -> None:
        iso.libc.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.s["parent_pid"]:
            os._exit(1)
        # The host's /proc, kept open for the template's own needs: the minimal root has none.
        self.procfd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        feats = iso.setup_isolation(self.s, self.procfd)
        self.cs = iso.prepare_calls(feats, self.s, self.procfd)
        for name in ("ast", "io", "linecache", "traceback", "types"):  # what _run_program needs
            importlib.import_module(name)
        loaded, missing = [], []
        for name in self.s["preload"]:   # inside the minimal root: a file missing there shows up here
            try:
                importlib.import_module(name)
                loaded.append(name)
            except Exception as e:  # noqa: BLE001 - a missing optional module is reported, not fatal
                missing.append(f"{name}: {type(e).__name__}: {e}")
        child.init_stdio()
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        gc.collect()
        gc.freeze()  # keep the collector from touching (and so copying) the template's pages in children
        self.feats, self.as_base = feats, iso.vm_size_bytes(self.procfd)
        self.uids = None
        if feats["uid_drop"]:
            self.uids = [int(self.s["uid_base"]) + i for i in range(int(self.s["slots"]))]
        # Before any request: the zygote's memory holds none, and every call's child is cloned from it.
        self.zygote = zygote.start(feats, self.cs, self.procfd, self.as_base)
        for fd in (self.ctrl_in, self.ctrl_out):
            os.set_blocking(fd, False)
        self.sel.register(self.ctrl_in, selectors.EVENT_READ, "ctrl")
        # The zygote's answers (a call's pid), and its EOF when it dies: an idle template then stops too.
        self.sel.register(self.zygote.sock, selectors.EVENT_READ, "zygote")
        self._send({"hello": True, "kind": self.s["kind"], "pid": os.getpid(), "features": feats,
                    "preloaded": loaded, "missing": missing, "vm_mb": self.as_base >> 20,
                    "zygote_pid": self.zygote.pid})

    # -- messages
    def _send(self, msg: dict) -> None:
        had = bool(self.outbuf)
        self.outbuf += frames.frame(msg)
        if not had:
            self._flush_out()

    def _flush_out(self) -> None:
        while self.outbuf:
            try:
                n = os.write(self.ctrl_out, self.outbuf)
            except BlockingIOError:
                break
            del self.outbuf[:n]
        key = self.sel.get_map().get(self.ctrl_out)
        if self.outbuf and key is None:
            self.sel.register(self.ctrl_out, selectors.EVENT_WRITE, "ctrl_out")
        elif not self.outbuf and key is not None:
            self.sel.unregister(self.ctrl_out)

    def _read_ctrl(self) -> None:
        while True:
            try:
                data = os.read(self.ctrl_in, 1 << 20)
            except BlockingIOError:
                break
            if not data:  # the service went away: stop
                self.stopping = True
                self.sel.unregister(self.ctrl_in)
                return
            self.inbuf += data
        for msg in frames.unframe(self.inbuf):
            if msg is None:
                self.stopping = True
            else:
                self.pending.append(msg)


    # -- loop
    def loop(self) -> None:
        while not (self.stopping and not self.calls and not self.cloning and not self.pending and not self.outbuf):
            if self.stopping and (self.calls or self.cloning):
                for call in [*self.calls.values(), *self.cloning]:
                    if call.kill_reason is None:
                        self._kill(call, "timeout")
            if self.stopping:
                self.pending.clear()
            while self.pending and self.free_slots:
                req = self.pending.popleft()
                try:
                    self._spawn(req)
                except OSError as e:  # e.g. out of fds: this call fails, not the template
                    self._send_spawn_error(req, e)
            now = time.monotonic()
            timeout = None
            for call in self.calls.values():
                if call.kill_reason is None and not call.exited:
                    if call.deadline <= now:
                        self._kill(call, "timeout")
                    else:
                        left = call.deadline - now
                        timeout = left if timeout is None else min(timeout, left)
            while self.dead_ns:   # one message per loop turn: fewer wake-ups of the reaper
                if iso.hand_over(self.cs.reaper, self.dead_ns[:iso.MAX_HANDOVER]):
                    del self.dead_ns[:iso.MAX_HANDOVER]
                elif len(self.dead_ns) > MAX_DEAD_NS:   # the reaper is far behind: tear down here
                    os.close(self.dead_ns.pop(0))
                else:
                    break   # retried on the next loop turn
            try:
                events = self.sel.select(timeout)
            except InterruptedError:
                continue
            for key, _ in events:
                role = key.data
                if role == "ctrl":
                    self._read_ctrl()
                elif role == "zygote":
                    self._on_zygote()   # RuntimeError when it died: the service restarts this template
                elif role == "ctrl_out":
                    try:
                        self._flush_out()
                    except BrokenPipeError:
                        self.stopping, self.outbuf = True, bytearray()
                        self.sel.unregister(self.ctrl_out)
                else:
                    owner = self.fd_owner.get(key.fd)
                    if owner is None:
                        continue
                    call, _ = owner
                    if role == "exit":
                        self._on_exit(call)
                    elif role in ("in", "code"):
                        self._write_input(call, role)
                    else:
                        self._read_stream(call, key.fd, role)


def main() -> None:
    settings = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # PDEATHSIG cleans up the children
    tpl = Template(settings)
    tpl.start()
    try:
        tpl.loop()
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise


if __name__ == "__main__":
    main()
