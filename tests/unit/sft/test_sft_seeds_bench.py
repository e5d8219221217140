"""bench/sft_seeds.py's crossing step: the first step whose 50-step mean loss is below the threshold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "sft_seeds.py"


def _bench():
    spec = importlib.util.spec_from_file_location("sft_seeds_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_crossing_is_the_first_step_whose_window_mean_is_below_the_threshold():
    crossing = _bench().crossing
    # 40 low steps after 100 high ones: mean (0.3 * 10 + 0.05 * 40) / 50 = 0.1 < 0.102 at step 140, not before
    assert crossing([0.3] * 100 + [0.05] * 100, 0.102) == 140
    assert crossing([0.3] * 100 + [0.05] * 39 + [0.3] * 100, 0.102) is None   # a dip too short to count
    assert crossing([0.3] * 200, 0.1) is None
    assert crossing([0.05] * 49, 0.1) is None        # fewer steps than the window
    assert crossing([0.05] * 50, 0.1) == 50


def test_screening_stops_after_the_crossing_or_at_the_cap_and_not_before():
    should_stop = _bench().should_stop
    crossed = [0.3] * 100 + [0.05] * 40          # crosses at step 140 (threshold 0.102)
    assert not should_stop(crossed, 0.102, None, None)           # a full run never stops early
    assert not should_stop(crossed, 0.102, 10, None)             # 0 steps past the crossing
    assert should_stop(crossed + [0.05] * 10, 0.102, 10, None)   # 10 past it
    assert not should_stop(crossed + [0.05] * 9, 0.102, 10, None)
    assert should_stop([0.3] * 120, 0.102, 10, 120)              # never crossed: the cap
    assert not should_stop([0.3] * 119, 0.102, 10, 120)
    assert should_stop(crossed, 0.102, 0, None)                  # stop at the crossing itself
