"""run_sft: loss falls on a small fixed set; interrupted + resumed training gives identical weights and
metrics; metrics and checkpoints are where the contract says."""

import json

import pytest
import torch
from safetensors.torch import load_file
from sft_test_config import small_cfg

from rstar2_core import storage
from rstar2_core.faults import InjectedFault
from rstar2_core.models.io import latest_complete, read_meta
from rstar2_core.sft.data import build_sft_dataset
from rstar2_core.sft.train import run_sft


def _weights(url):
    return load_file(str(storage.to_local_path(url) / "model.safetensors"))


@pytest.mark.slow
def test_sft_loss_falls_on_small_fixed_set(sft_assets, tmp_path):
    base, data, _ = sft_assets
    cfg = small_cfg("sft.epochs=8", "sft.batch_size=2", "sft.micro_batch_size=1", "sft.lr=5e-3")
    log = []
    res = run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=(tmp_path / "sft").as_uri(),
                  log_metrics=lambda m, s: log.append((s, m)))
    losses = [m["sft/loss"] for _, m in log]
    assert [s for s, _ in log] == list(range(1, res.steps + 1)) and res.steps >= 12
    assert {"sft/loss", "sft/lr", "sft/grad_norm", "sft/tokens_per_s"} <= set(log[0][1])
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:2]) / 2, losses
    assert res.checkpoint_url.endswith("/final") and storage.is_complete(res.checkpoint_url)
    lrs = [m["sft/lr"] for _, m in log]
    assert max(lrs) == pytest.approx(5e-3) and lrs[-1] < 0.1 * 5e-3      # warm-up then cosine to ~0


@pytest.mark.slow
def test_resume_after_fault_gives_identical_weights_and_metrics(sft_assets, tmp_path, monkeypatch):
    base, data, _ = sft_assets
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "home"))   # fresh fault markers
    cfg = small_cfg("sft.epochs=2", "sft.batch_size=2", "sft.micro_batch_size=1", "sft.checkpoint_every=2")
    straight_log = []
    straight = run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=(tmp_path / "a").as_uri(),
                       log_metrics=lambda m, s: straight_log.append((s, m)))
    assert straight.steps >= 5

    out = (tmp_path / "b").as_uri()
    log = []
    monkeypatch.setenv("RSTAR2_FAULT_INJECT", "sft:step=4")
    with pytest.raises(InjectedFault):
        run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=out, log_metrics=lambda m, s: log.append((s, m)))
    assert [s for s, _ in log] == [1, 2, 3]
    steps_dir = tmp_path / "b" / "steps"
    assert latest_complete(steps_dir.as_uri()).endswith("step-000002")
    # a checkpoint whose write was interrupted (no _COMPLETE marker) must be ignored on resume
    (steps_dir / "step-000003").mkdir()
    (steps_dir / "step-000003" / "model.safetensors").write_bytes(b"partial")
    log.clear()
    resumed = run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=out,
                      log_metrics=lambda m, s: log.append((s, m)))
    assert resumed.extra["resumed_from"].endswith("step-000002")
    assert [s for s, _ in log] == list(range(3, straight.steps + 1))
    for (s, m), (s2, m2) in zip(log, straight_log[2:]):
        assert s == s2 and m["sft/loss"] == m2["sft/loss"] and m["sft/grad_norm"] == m2["sft/grad_norm"]
    wa, wb = _weights(straight.checkpoint_url), _weights(resumed.checkpoint_url)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert read_meta(resumed.checkpoint_url)["step"] == straight.steps
    # a finished stage returns its final checkpoint without training again
    again = run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=out)
    assert again.checkpoint_url == resumed.checkpoint_url and again.extra == {"resumed_final": True}


def test_external_sft_rows_validated_and_counted(tmp_path, sft_assets):
    _, _, ref = sft_assets
    # the tiny profile's direct demonstrations (direct_answer_share 0.5) come on top of the 16 tool ones
    assert ref.n_rows == 32 and ref.counts["direct"] == 16 and ref.counts["failed_first"] == 4
    assert len(ref.digest) == 64
    good = {"problem": "What is 1+1?", "turns": [["\nAdd.\n</reason>\n<answer>\\boxed{2}</answer>", None]]}
    bad = [
        "{not json",
        json.dumps({"turns": good["turns"]}),
        json.dumps({"problem": "p", "turns": [["a", ["r"]], ["b", ["r2"]]]}),
        json.dumps({"problem": "p", "turns": [["a", None], ["b", None]]}),
        json.dumps({"problem": "p", "turns": [["<reason>x", None]]}),
        json.dumps({**good, "mask_answer": True, "answer": "3"}),     # its box says 2: nothing to mask
        json.dumps({**good, "mask_answer": True}),                    # no answer given
    ]
    src = tmp_path / "extra.jsonl"
    src.write_text("\n".join([json.dumps(good), *bad, json.dumps(good)]) + "\n")
    cfg = small_cfg("data.synthetic.enabled=false", f'data.sft_sources=["{src.as_uri()}"]')
    out = build_sft_dataset(cfg, (tmp_path / "sft.jsonl").as_uri())
    assert out.n_rows == 2
    assert out.counts == {f"source/{src.as_uri()}": 2, "format/rstar2": 2, "rejected/invalid_json": 1,
                          "rejected/missing_problem": 1,
                          "rejected/last_turn_has_tool_results": 1, "rejected/missing_tool_results": 1,
                          "rejected/first_turn_repeats_reason_tag": 1,
                          "rejected/mask_answer_without_its_boxed_answer": 2}
    src.write_text("\n".join(bad) + "\n")
    with pytest.raises(ValueError, match="SFT set is empty"):
        build_sft_dataset(cfg, (tmp_path / "sft2.jsonl").as_uri())


@pytest.mark.slow
def test_sft_stops_after_converging_and_past_max_steps_repeats_the_conversations(sft_assets, tmp_path):
    """`sft.max_steps` beyond a pass repeats the conversations in a fresh order; `converged_loss` (here
    loose enough for the first window) marks the step the 3-step running mean fell below it, and
    `steps_after_converged` stops the run that many steps later, the final checkpoint taken there."""
    base, data, _ = sft_assets
    one_pass = run_sft(small_cfg("sft.batch_size=2", "sft.micro_batch_size=1"), base_model_url=base,
                       sft_data_url=data, out_url=(tmp_path / "pass").as_uri()).steps
    log = []
    cfg = small_cfg("sft.batch_size=2", "sft.micro_batch_size=1", f"sft.max_steps={2 * one_pass + 1}",
                    "sft.converged_loss=100", "sft.converged_window=3", "sft.steps_after_converged=2",
                    "sft.schedule=constant")
    res = run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=(tmp_path / "conv").as_uri(),
                  log_metrics=lambda m, s: log.append((s, m)))
    assert res.steps == 3 + 2 and [s for s, _ in log] == [1, 2, 3, 4, 5]
    assert "sft/converged_step" not in log[1][1] and log[2][1]["sft/converged_step"] == 3
    assert read_meta(res.checkpoint_url)["step"] == 5 and res.metrics["sft/steps"] == 5
    log.clear()
    long = run_sft(cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"steps_after_converged": None})}),
                   base_model_url=base, sft_data_url=data, out_url=(tmp_path / "long").as_uri(),
                   log_metrics=lambda m, s: log.append((s, m)))
    assert long.steps == 2 * one_pass + 1 and log[-1][1]["sft/epoch"] > 2.0      # past two passes


@pytest.mark.slow
def test_sft_that_does_not_converge_fails_at_sft_and_its_retry_draws_another_order(sft_assets, tmp_path):
    from rstar2_core.errors import SFTNotConverged
    from tasks.retry import is_infrastructure_error

    base, data, _ = sft_assets
    cfg = small_cfg("sft.batch_size=2", "sft.micro_batch_size=1", "sft.checkpoint_every=2",
                    "sft.converged_loss=1e-6", "sft.converged_window=2")
    out = (tmp_path / "sft").as_uri()
    first: list = []
    with pytest.raises(SFTNotConverged, match=r"mean loss of its last 2 steps is [0-9.]+, above sft.converged_loss"
                                              r" = 1e-06, after \d+ steps \(draw 1\)") as e:
        run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=out, log_metrics=lambda m, s: first.append(m))
    assert e.value.threshold == 1e-6 and e.value.draw == 0 and e.value.loss > 1e-6
    assert is_infrastructure_error(e.value)                       # retried by the pipeline's rule
    assert not storage.is_complete(storage.join(out, "final"))    # nothing downstream trains on it
    assert latest_complete(storage.join(out, "steps")) is None    # the retry does not resume this draw
    second: list = []
    with pytest.raises(SFTNotConverged, match=r"\(draw 2\)"):
        run_sft(cfg, base_model_url=base, sft_data_url=data, out_url=out, log_metrics=lambda m, s: second.append(m))
    assert [m["sft/loss"] for m in second] != [m["sft/loss"] for m in first]     # another data order
