import pytest

from rstar2_core.faults import InjectedFault, maybe_inject_fault, parse_fault_spec


def test_fault_fires_once(monkeypatch, tmp_path):
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path))
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=3")
    maybe_inject_fault("rl-stage-1", 2)
    maybe_inject_fault("rl-stage-2", 3)
    with pytest.raises(InjectedFault):
        maybe_inject_fault("rl-stage-1", 3)
    maybe_inject_fault("rl-stage-1", 3)  # the retry goes through


def test_bad_spec_says_the_format():
    with pytest.raises(ValueError, match="<stage>:step=<n>"):
        parse_fault_spec("rl-stage-1@3")
