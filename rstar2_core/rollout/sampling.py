"""Batched token sampling with per-request seeds, and stop detection, for the HF engine.

`sample_rows` draws one token for every row of a (rows, vocab) logits batch in one vectorised pass:
row r's uniform is `counter_uniform(seed_r, counter_r)` (SplitMix64 of the seed and the index of the
token in the request's output, on the device in int64), its token the inverse CDF of that uniform.
`StopChecker` finds stop strings by decoding only the last few tokens after each step.
Invariant: a request's tokens depend only on its seed, its logits and its own settings, never on the
batch or its row; the returned logprob is `log_softmax(logits / temperature)[token]` before top-p,
the quantity the trainer recomputes. See docs/rollout.md, "HFEngine" (Sampling, Stops).
"""

from __future__ import annotations

import secrets

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GAMMA = _signed(0x9E3779B97F4A7C15)    # SplitMix64's increment
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def seed_value(seed: int | None) -> int:
    """The int64 seed a request samples with: its own (taken mod 2^64), or a fresh random one."""
    return _signed(secrets.randbits(64) if seed is None else int(seed))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """seeds, counters: (rows,) int64 -> (rows,) float64 uniforms in [0, 1).

    Output `counter` of SplitMix64 seeded with `seed` (Steele et al. 2014; passes BigCrush): int64
    multiplication wraps modulo 2^64 on every torch device, which is the arithmetic it needs.
    """
    z = seeds + (counters + 1) * _GAMMA
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * (2.0 ** -53)


def reference_uniform(seed: int, counter: int) -> float:
    """Pure-Python SplitMix64 (the specification `counter_uniform` is tested against)."""
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0 ** -53


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: (rows, n) >= 0, u: (rows,) in [0, 1) -> (rows,) index i with cdf[i - 1] <= u x total < cdf[i]."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    x = (u * cdf[:, -1]).unsqueeze(1)
    # right=True: the first index whose cdf exceeds x, so a zero-probability entry is never chosen
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
                any_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. logits: (rows, vocab); temperature, top_p: (rows,) float; uniforms: (rows,)
    float64 from `counter_uniform`; any_top_p: whether some row has top_p < 1 (the host knows it).

    Returns (tokens (rows,) int64, logprobs (rows,) float32), logprobs as in the module docstring.
    """
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / temp.unsqueeze(1), -1)
    probs = logp.exp()
    tokens = _inverse_cdf(probs, uniforms)
    if any_top_p:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        keep = (torch.cumsum(sorted_p, -1) - sorted_p) < top_p.unsqueeze(1)      # always keeps the top token
        nucleus = order.gather(1, _inverse_cdf(sorted_p * keep, uniforms).unsqueeze(1)).squeeze(1)
        tokens = torch.where(top_p < 1.0, nucleus, tokens)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


class StopChecker:
    """Detects the first stop string completed by the newest token of a growing sequence."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tokenizer, self.stop_strings = tokenizer, tuple(s for s in stop_strings if s)
        # one token always decodes to >= 1 character, so this many tokens cover any stop string;
        # +2 absorbs a partial UTF-8 byte at the window's start
        self.window = max((len(s) for s in self.stop_strings), default=0) + 2

    def check(self, token_ids: list[int]) -> str | None:
        """The stop string that the last token completed, or None. Call after every token."""
        if not self.stop_strings:
            return None
        tail = self.tokenizer.decode(token_ids[-self.window:], skip_special_tokens=False)
        # an earlier occurrence would have stopped the sequence at an earlier token
        for s in self.stop_strings:
            if s in tail:
                return s
        return None
