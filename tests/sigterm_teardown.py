"""A pytest plugin (tests/conftest.py loads it): SIGTERM to the test session (a CI job's timeout, `timeout`,
a kill by PID) stops it as Ctrl-C does, so pytest tears down every fixture in use (servers, clusters, the
rehearsal's service stack) instead of leaving their processes running. A process forked from the session
gets the default action back before the signal is delivered again."""

from __future__ import annotations

import os
import signal
import threading

_SESSION_PID = os.getpid()


def _interrupt(signum, frame):
    if os.getpid() != _SESSION_PID:           # a forked child: terminate as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: stopping the session, tearing fixtures down")


def pytest_configure(config):
    global _SESSION_PID
    if threading.current_thread() is threading.main_thread():
        _SESSION_PID = os.getpid()
        signal.signal(signal.SIGTERM, _interrupt)
