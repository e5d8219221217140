"""Per-request token sampling and stop detection for the HF engine.

`sample_token` draws one token for one sequence from its own `torch.Generator`, so a request's
tokens depend only on its seed and its logits, never on which other requests share the batch.

Logprob convention (documented in docs/rollout.md): the returned logprob is
`log_softmax(logits / temperature)[token]`, i.e. under the temperature-scaled distribution *before*
top-p truncation. That is the quantity the trainer recomputes from the same logits, so the
importance ratio is exactly 1 on-policy. With top_p = 1 (the paper) it is also exactly the sampling
distribution; with top_p < 1 the sampling distribution renormalises over the nucleus and differs by
log(nucleus mass) (vLLM's default "raw" logprobs make the same choice). temperature = 0 means
greedy (argmax) with logprobs under temperature 1.

`StopChecker` finds stop strings incrementally: after each token it decodes only the last few
tokens (enough to cover the longest stop string), so the cost per token is constant.
"""

from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[int, float]:
    """logits: (vocab,) float. Returns (token id, logprob under the temperature-scaled distribution)."""
    logits = logits.float()
    if temperature <= 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sorted_p, -1) - sorted_p) < top_p      # always keeps the top token
        nucleus = torch.zeros_like(probs)
        nucleus[order[keep]] = sorted_p[keep]
        probs = nucleus
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


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
