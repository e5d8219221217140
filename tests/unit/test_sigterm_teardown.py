"""SIGTERM to a test session tears its fixtures down (tests/sigterm_teardown.py): a session whose test is
running gets SIGTERM, and the fixture's teardown still runs before the process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODULE = '''
import pathlib, time
import pytest

@pytest.fixture(scope="session")
def server():
    yield
    pathlib.Path({down!r}).write_text("torn down")

def test_long(server):
    pathlib.Path({started!r}).write_text("started")
    time.sleep(120)
'''


def test_sigterm_tears_the_sessions_fixtures_down(tmp_path):
    started, down = tmp_path / "started", tmp_path / "down"
    (tmp_path / "test_mod.py").write_text(MODULE.format(started=str(started), down=str(down)))
    tests = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sigterm_teardown",
                          "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path / "test_mod.py")],
                         env={"PYTHONPATH": str(tests), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not started.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-2000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert down.read_text() == "torn down", out[-2000:]
    assert p.returncode != 0 and "KeyboardInterrupt" in out, out[-2000:]
