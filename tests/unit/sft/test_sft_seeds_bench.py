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
