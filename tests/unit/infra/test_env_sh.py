"""scripts/env.sh: an RSTAR2_HOME inherited from another checkout's shell is refused, unless shared on purpose;
one chosen elsewhere is named, once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _source(home: str | None, twice: bool = False, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RSTAR2_HOME", "RSTAR2_HOME_NOTED", "RSTAR2_SHARED_HOME")}
    env.update(extra)
    if home is not None:
        env["RSTAR2_HOME"] = home
    cmd = ("source scripts/env.sh && " + ("bash -c 'source scripts/env.sh' && " if twice else "")
           + 'echo "$RSTAR2_HOME"')
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, check=check)


def test_an_inherited_home_outside_the_checkout_is_named_once(tmp_path):
    other = str(tmp_path / "other-checkout" / ".rstar2")
    out = _source(other, twice=True)
    assert out.stdout.strip() == other
    assert out.stderr.count("lies outside this checkout") == 1, out.stderr
    assert f"unset RSTAR2_HOME to use {ROOT}/.rstar2" in out.stderr
    for home in (None, str(ROOT / ".rstar2" / "test")):
        quiet = _source(home)
        assert quiet.stderr == "" and quiet.stdout.strip() == (home or str(ROOT / ".rstar2"))


def test_another_checkouts_state_is_refused_unless_shared_on_purpose(tmp_path):
    other = tmp_path / "other-clone"
    (other / "scripts").mkdir(parents=True)
    (other / "scripts" / "env.sh").write_text("# another checkout\n")
    home = str(other / ".rstar2")
    out = _source(home, check=False)
    assert out.returncode != 0 and out.stdout == "", out
    assert f"the state of another checkout ({other})" in out.stderr and "RSTAR2_SHARED_HOME=1" in out.stderr
    # `make` sources it with `&&`: nothing after it runs
    shared = _source(home, RSTAR2_SHARED_HOME="1")
    assert shared.stdout.strip() == home and "lies outside this checkout" in shared.stderr
