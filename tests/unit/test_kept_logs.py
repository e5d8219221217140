"""The node logs of a local cluster outlive a module whose test failed (tests/kept_logs.py, what
tests/cluster/test_multinode.py's cluster fixture uses), and are removed when every test passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MODULE = '''
import pytest
from kept_logs import kept_if_a_test_fails

@pytest.fixture(scope="module")
def logs(request):
    with kept_if_a_test_fails(request, {root!r}, "the cluster's node logs") as root:
        (root / "raylet.out").write_text("node log")
        yield root

def test_uses_the_cluster(logs):
    assert {passes}
'''


@pytest.mark.parametrize("passes", [True, False])
def test_the_logs_are_kept_only_when_a_test_failed(tmp_path, passes):
    root = tmp_path / "cluster"
    root.mkdir()
    (tmp_path / "test_mod.py").write_text(MODULE.format(root=str(root), passes=passes))
    tests = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "-c", "/dev/null", str(tmp_path / "test_mod.py")], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tests), "PATH": "/usr/bin:/bin"}, check=False)
    assert r.returncode == (0 if passes else 1), r.stdout[-2000:]
    assert (root / "raylet.out").exists() == (not passes)
    assert (f"the cluster's node logs kept in {root}" in r.stdout) == (not passes), r.stdout[-2000:]
