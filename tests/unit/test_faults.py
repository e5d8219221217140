import pytest

from rstar2_core.faults import FAULT_KINDS, InjectedFault, maybe_inject_fault, parse_fault_spec


def test_fault_fires_once_per_run_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=3")
    run_a, run_b = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    assert maybe_inject_fault("rl-stage-1", 2, run_a) is None
    assert maybe_inject_fault("rl-stage-2", 3, run_a) is None
    with pytest.raises(InjectedFault):
        maybe_inject_fault("rl-stage-1", 3, run_a)
    assert maybe_inject_fault("rl-stage-1", 3, run_a) is None   # the retry of that run goes through
    with pytest.raises(InjectedFault):                           # a fresh run fails again
        maybe_inject_fault("rl-stage-1", 3, run_b)


def test_other_kinds_are_returned_for_the_runtime(monkeypatch, tmp_path):
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "rl-stage-1:step=2:kill-engine, rl-stage-1:step=3:engine-errors")
    run = tmp_path.as_uri()
    assert maybe_inject_fault("rl-stage-1", 2, run) == "kill-engine"
    assert maybe_inject_fault("rl-stage-1", 2, run) is None
    assert maybe_inject_fault("rl-stage-1", 3, run) == "engine-errors"
    assert parse_fault_spec("sft:step=1") == [("sft", 1, "raise")]
    assert set(FAULT_KINDS) == {"raise", "kill-engine", "kill-trainer", "kill-node", "kill-sandbox", "engine-errors", "stale-weights"}


@pytest.mark.parametrize("spec", ["rl-stage-1@3", "rl-stage-1:step=x", "rl-stage-1:step=2:explode"])
def test_bad_spec_says_the_format(spec):
    with pytest.raises(ValueError, match=r"<stage>:step=<n>\[:<kind>\]"):
        parse_fault_spec(spec)


def test_stale_weights_move_every_float_tensor_by_noise_of_its_own_scale():
    import torch

    from rstar2_core.faults import stale_weights

    sd = {"w": torch.full((64, 64), 2.0) + torch.arange(4096.0).reshape(64, 64) / 4096, "i": torch.arange(3)}
    out = stale_weights(sd, noise=0.5, seed=1)
    assert torch.equal(out["i"], sd["i"])                       # integer buffers are left alone
    moved = (out["w"] - sd["w"]).std().item()
    assert 0.4 * sd["w"].std().item() < moved < 0.6 * sd["w"].std().item()
    assert torch.equal(stale_weights(sd, noise=0.5, seed=1)["w"], out["w"])        # seeded
