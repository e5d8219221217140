"""The response-length model behind KV-aware admission: `LengthModel`.

It keeps an RL stage's last `window` finished response lengths in bins and answers two questions for
`KVAdmission` (admission.py): the survival curve S[b] = P(response >= b bins), a Kaplan-Meier estimate
with the running trajectories censored at their current length, and how alike lengths are within a
GRPO group (`group_correlation`, the intra-class correlation).
Invariant: where the data are thin (fewer than `min_at_risk` trajectories at risk) the remaining mass
sits at `max_tokens`, so a model that has observed nothing is exactly the paper's max-length rule.
See docs/rollout-scheduling.md, "The length model".
"""

from __future__ import annotations

from collections import deque

import numpy as np


class LengthModel:
    """Response-length distribution of a stage's trajectories, for KV projections.

    Keeps the last `window` finished response lengths (tokens, 0..max_tokens) in `n_bins` bins. Pass
    one instance to every `rollout_groups` call of an RL stage so each step starts from what the
    earlier steps observed; a fresh one starts at the paper's max-length rule and learns within the step.
    """

    def __init__(self, max_tokens: int, n_bins: int = 128, window: int = 8192, min_at_risk: int = 16):
        if max_tokens < 1 or n_bins < 1 or window < 1 or min_at_risk < 1:
            raise ValueError(f"LengthModel needs positive max_tokens, n_bins, window and min_at_risk "
                             f"(got {max_tokens}, {n_bins}, {window}, {min_at_risk})")
        self.max_tokens, self.min_at_risk = max_tokens, min_at_risk
        self.bin_tokens = -(-max_tokens // n_bins)
        self.n_bins = max_tokens // self.bin_tokens + 1
        self._recent: deque[tuple[object, int]] = deque(maxlen=window)
        self._events = np.zeros(self.n_bins, dtype=np.int64)
        self._groups: dict[object, list[float]] = {}        # group -> [count, sum, sum of squares]
        self.version = 0

    def bin(self, tokens: int) -> int:
        return min(max(tokens, 0), self.max_tokens) // self.bin_tokens

    def observe(self, tokens: int, group: object = None) -> None:
        """Record a finished trajectory's response length; `group` (hashable, unique across steps: its
        GRPO group) lets the model measure how alike the lengths within a group are (`group_correlation`)."""
        tokens = min(max(int(tokens), 0), self.max_tokens)
        if len(self._recent) == self._recent.maxlen:
            old_group, old = self._recent[0]
            self._events[self.bin(old)] -= 1
            self._tally(old_group, old, -1)
        self._recent.append((group, tokens))
        self._events[self.bin(tokens)] += 1
        self._tally(group, tokens, +1)
        self.version += 1

    def _tally(self, group: object, tokens: int, sign: int) -> None:
        if group is None:
            return
        agg = self._groups.setdefault(group, [0, 0.0, 0.0])
        agg[0] += sign
        agg[1] += sign * tokens
        agg[2] += sign * tokens * tokens
        if agg[0] == 0:
            del self._groups[group]

    def group_correlation(self) -> float:
        """Intra-class correlation of response lengths within groups (one-way ANOVA estimator over the
        groups with two or more finished samples), in [0, 1]; 0 until 8 such groups were seen."""
        aggs = [a for a in self._groups.values() if a[0] >= 2]
        if len(aggs) < 8:
            return 0.0
        n = sum(a[0] for a in aggs)
        total = sum(a[1] for a in aggs)
        between = sum(a[1] ** 2 / a[0] for a in aggs) - total ** 2 / n
        within = sum(a[2] - a[1] ** 2 / a[0] for a in aggs)
        g = len(aggs)
        msb, msw = between / (g - 1), within / max(1, n - g)
        n0 = (n - sum(a[0] ** 2 for a in aggs) / n) / (g - 1)
        denom = msb + (n0 - 1) * msw
        return float(min(1.0, max(0.0, (msb - msw) / denom))) if denom > 0 else 0.0

    @property
    def n_observed(self) -> int:
        return len(self._recent)

    def survival(self, censored: np.ndarray) -> np.ndarray:
        """`S[b]` = P(response >= b * bin_tokens), b = 0..n_bins (S[n_bins] = 0), given running
        trajectories censored in bins `censored[b]` (counts). Kaplan-Meier over the bins; from the first
        bin with fewer than `min_at_risk` trajectories at risk on, the remaining mass sits at `max_tokens`
        (with nothing observed: every trajectory reaches the maximum, the paper's assumption)."""
        nb = self.n_bins
        at_risk = np.cumsum((self._events + censored)[::-1])[::-1]
        s = np.zeros(nb + 1)
        s[0] = 1.0
        for b in range(nb):
            if at_risk[b] < self.min_at_risk:
                s[b:nb] = s[b]
                break
            s[b + 1] = s[b] * (1.0 - self._events[b] / at_risk[b])
        s[nb] = 0.0
        return s
