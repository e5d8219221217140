"""Correctness gates of the GPU check (bench/gpu_check.py): does HFEngine compute what the model computes?

`greedy_gate` (engine greedy == `model.generate` greedy, also on prompts sharing a 96-token prefix; a
divergence passes only at a near tie, logits within `TIE_GAP`), `logprob_gate` (engine logprobs ==
a teacher-forced forward within `tol`), `rng_gate` (the device's counter-based uniforms == the
pure-Python SplitMix64 reference) and `head_kernel_gate` (Liger's fused head == the chunked torch path:
log-probs and both gradients). Each returns a dict with `ok`. Run in fp32 with TF32 off.
Invariant: needs only torch + rstar2_core's rollout and token_logprobs modules.
See docs/production.md, "GPU check".
"""

from __future__ import annotations

import asyncio
import types

import torch

TIE_GAP = 1e-3          # fp32 logits closer than this: argmax is a rounding decision


def fixed_prompts(vocab: int, n: int = 6, seed: int = 1234) -> list[list[int]]:
    """n prompts of different lengths (3..33 tokens), the same on every run."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 3, 33, 9, 24, 12, 7][:n]
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def shared_prompts(vocab: int, n: int = 6, prefix: int = 96, seed: int = 4321) -> list[list[int]]:
    """n prompts that start with the same `prefix` tokens (tails of 1..24 tokens), the same on every run."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    return [head + torch.randint(3, vocab, (k,), generator=g).tolist() for k in [5, 17, 1, 24, 9, 12, 3, 7][:n]]


async def _engine_outputs(engine, prompts, params_for):
    try:
        return await asyncio.gather(*[engine.generate(p, params_for(i)) for i, p in enumerate(prompts)])
    finally:
        await engine.close()


def _teacher_forced_logits(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """(len(out), vocab) fp32 logits predicting each token of `out` after prompt + out[:i]."""
    ids = torch.tensor([prompt + list(out)], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(out)]


def greedy_gate(model, make_engine, variants: dict[str, dict], new_tokens: int, slots: int = 4,
                prompts: list[list[int]] | None = None) -> dict:
    """variants: name -> extra HFEngine kwargs. make_engine(model, slots, max_len, **kw) -> HFEngine.
    Each variant reports how many decode steps read a shared prefix once (`shared_prefix_steps`)."""
    from rstar2_core.rollout.types import SamplingParams

    prompts = prompts or fixed_prompts(model.config.vocab_size)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
            refs.append(gen[0, len(p):].tolist())
    res: dict = {"prompts": len(prompts), "new_tokens": new_tokens, "tie_gap": TIE_GAP, "variants": {}}
    max_len = max(len(p) for p in prompts) + new_tokens + 8
    for name, kw in variants.items():
        engine = make_engine(model, slots, max_len, **kw)
        outs = asyncio.run(_engine_outputs(engine, prompts,
                                           lambda i: SamplingParams(max_new_tokens=new_tokens, temperature=0.0)))
        exact, ties, wrong = 0, 0, []
        for k, (p, ref, out) in enumerate(zip(prompts, refs, outs)):
            got = list(out.token_ids)
            if got == ref:
                exact += 1
                continue
            i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            if i < min(len(got), len(ref)):
                logits = _teacher_forced_logits(model, p, ref[: i + 1])[i]
                gap = float(logits[ref[i]] - logits[got[i]])
                if abs(gap) < TIE_GAP:
                    ties += 1
                    continue
                wrong.append({"prompt": k, "first_diff": i, "logit_gap": gap})
            else:
                wrong.append({"prompt": k, "lengths": [len(got), len(ref)]})
        res["variants"][name] = {"exact": exact, "near_ties": ties, "wrong": wrong, "ok": not wrong,
                                 "shared_prefix_steps": engine.stats["shared_prefix_steps"]}
    res["ok"] = all(v["ok"] for v in res["variants"].values())
    return res


def logprob_gate(model, make_engine, new_tokens: int, tol: float, slots: int = 4, **engine_kw) -> dict:
    from rstar2_core.rollout.types import SamplingParams

    prompts = fixed_prompts(model.config.vocab_size)
    max_len = max(len(p) for p in prompts) + new_tokens + 8
    outs = asyncio.run(_engine_outputs(make_engine(model, slots, max_len, **engine_kw), prompts,
                                       lambda i: SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                seed=100 + i)))
    worst = 0.0
    for p, out in zip(prompts, outs):
        logp = torch.log_softmax(_teacher_forced_logits(model, p, list(out.token_ids)), -1)
        ref = logp.gather(1, torch.tensor(out.token_ids, device=logp.device)[:, None])[:, 0].cpu()
        worst = max(worst, float((ref - torch.tensor(out.logprobs)).abs().max()))
    return {"max_abs_diff": worst, "tol": tol, "tokens": sum(len(o.token_ids) for o in outs), "ok": worst <= tol}


def rng_gate(device: torch.device) -> dict:
    from rstar2_core.rollout.sampling import counter_uniform, reference_uniform, seed_value

    seeds = [0, 1, 2**63 - 1, -(2**63), seed_value(2**64 - 1), 123456789]
    counters = [0, 1, 7, 2**31, 2**40 + 3, 99]
    got = counter_uniform(torch.tensor(seeds, device=device), torch.tensor(counters, device=device)).cpu().tolist()
    want = [reference_uniform(s, c) for s, c in zip(seeds, counters)]
    return {"pairs": len(seeds), "ok": got == want}


class LMHead(torch.nn.Module):
    """An LM head alone, read the way `token_logprobs` reads a model (`get_output_embeddings()`,
    `config.vocab_size`). Weights ~ N(0, 0.1^2): with unit-variance hidden states of width ~900 the logits'
    std is ~3, a peaked distribution like a trained head's rather than the near-uniform one of a fresh init."""

    def __init__(self, hidden_size: int, vocab: int, device, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lm_head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(vocab, hidden_size, generator=g) * 0.1)
        self.config = types.SimpleNamespace(vocab_size=vocab)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


def head_inputs(head: LMHead, tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (tokens, H) ~ N(0, 1) in the head's dtype, target ids, and a per-token upstream gradient (fp32)."""
    w = head.lm_head.weight
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, w.shape[1], generator=g).to(w.device, w.dtype)
    targets = torch.randint(0, w.shape[0], (tokens,), generator=g).to(w.device)
    return hidden, targets, torch.randn(tokens, generator=g).to(w.device)


def head_forward_backward(head: LMHead, mode: str, hidden: torch.Tensor, targets: torch.Tensor,
                          upstream: torch.Tensor, temperature: float = 1.0):
    """`token_logprobs` through head kernel `mode` ("liger" where it cannot run raises, naming why), then the
    backward of sum(upstream x log-probs): (log-probs, grad w.r.t. hidden, grad w.r.t. the head's weight),
    as computed (the head's dtype)."""
    from rstar2_core.models import token_logprobs as tl

    tl.set_head_kernel(head, mode)
    h = hidden.detach().clone().requires_grad_(True)
    head.lm_head.weight.grad = None
    lp = tl.token_logprobs(head, h, targets, temperature)
    (lp * upstream).sum().backward()
    return lp.detach(), h.grad, head.lm_head.weight.grad


def head_pass(head: LMHead, mode: str, hidden: torch.Tensor, targets: torch.Tensor, upstream: torch.Tensor,
              temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`head_forward_backward`, each result in fp32 (for comparing two kernels)."""
    return tuple(x.float() for x in head_forward_backward(head, mode, hidden, targets, upstream, temperature))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `got` against `ref`."""
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def head_kernel_gate(device, hidden_size: int, vocab: int, tokens: int, tol: float, temperature: float = 0.7) -> dict:
    """Liger vs torch on one fp32 head (TF32 off is the caller's): max |log-prob diff| and the relative L2
    errors of both gradients must be <= `tol`."""
    head = LMHead(hidden_size, vocab, device, torch.float32)
    hidden, targets, upstream = head_inputs(head, tokens)
    ref = head_pass(head, "torch", hidden, targets, upstream, temperature)
    got = head_pass(head, "liger", hidden, targets, upstream, temperature)
    out = {"hidden_size": hidden_size, "vocab": vocab, "tokens": tokens, "temperature": temperature, "tol": tol,
           "logprob_max_abs_diff": float((got[0] - ref[0]).abs().max()),
           "grad_hidden_rel_err": rel_err(got[1], ref[1]), "grad_weight_rel_err": rel_err(got[2], ref[2])}
    out["ok"] = all(out[k] <= tol for k in ("logprob_max_abs_diff", "grad_hidden_rel_err", "grad_weight_rel_err"))
    return out
