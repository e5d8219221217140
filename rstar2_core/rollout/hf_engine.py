"""HFEngine: token-in/token-out generation over a transformers causal LM with continuous batching.

A background thread runs the decode loop. Between two decode steps it admits waiting requests into
free KV slots (prefilling each one's prompt into its slot) and retires finished ones, so requests
join and leave the running batch at token granularity: a trajectory that is waiting for its tool
holds no slot and stalls nobody. Each request samples from its own `torch.Generator`
(`SamplingParams.seed`), so its tokens do not depend on what else is in the batch.

Why not transformers' own continuous batching (`generate_batch` / `ContinuousBatchingManager`,
checked in 5.24): it samples every request with one shared `torch.multinomial` call and one
generation config, so per-request seeds/temperatures and stop strings are not supported, and
results depend on batch composition. Our loop is small: `kv_cache.SlotKVCache` (static per-slot
KV tensors with per-row positions and a 4D mask passed to the model's own forward) plus this file.

Prefix reuse: when a request finishes, its slot keeps the KV of the tokens it fed. A later request
whose prompt starts with those tokens (the same trajectory's next turn: previous prompt + its
generation + tool-response tokens) reuses that slot and prefills only the new suffix. This is why
the scheduler keeps a trajectory on one engine across turns. Free slots with no cached prefix are
used first; otherwise the least recently used cached prefix is evicted. A prefix shared with any
other slot, running or cached (the system prompt, the same problem's other samples), is copied from
it instead of prefilled (a memory copy of that many positions).

Weights: `update_weights(state_dict | checkpoint URI)` loads between decode steps under the same
lock the loop holds for each step, and drops every cached prefix (its KV came from the old weights).
Requests in flight continue with the new weights from the next token on.

GPU (issue 9): `static_shapes=True` makes each decode step span all slots and max_seq_len (fixed
shapes); `compile=True` additionally wraps the decode forward in `torch.compile(mode="reduce-overhead")`
(CUDA graphs). Neither is exercised on a GPU here; the static path is tested for equality on CPU.

    engine = HFEngine(model, tokenizer, max_batch_size=32, max_seq_len=1024)
    out = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64, seed=1))
    await engine.close()
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rstar2_core.rollout.kv_cache import SlotKVCache
from rstar2_core.rollout.sampling import StopChecker, make_generator, sample_token
from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.rollout.weights import load_state_dict_from_uri


class EngineClosed(RuntimeError):
    """The engine was closed while the request was waiting or running."""


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator
    stop: StopChecker
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    kv_len: int = 0          # tokens of prompt + output whose KV is in the slot
    cancelled: bool = False

    def fed_tokens(self) -> list[int]:
        return (self.prompt_ids + self.out_ids)[: self.kv_len]


class HFEngine:
    """Continuous-batching engine over an HF causal LM (see module docstring). Implements `Engine`."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int = 64,
                 device: str | torch.device = "cpu", *, max_seq_len: int | None = None,
                 kv_capacity_tokens: int | None = None, static_shapes: bool = False, compile: bool = False):
        cfg = model.config
        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        self.max_seq_len = int(max_seq_len or cfg.max_position_embeddings)
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}; pass max_seq_len <= that")
        self.slots = int(max_batch_size)
        if kv_capacity_tokens is not None and kv_capacity_tokens < self.max_seq_len:
            raise ValueError(f"kv_capacity_tokens={kv_capacity_tokens} is below one sequence of max_seq_len="
                             f"{self.max_seq_len}; raise it or lower max_seq_len")
        if kv_capacity_tokens:    # a memory budget smaller than slots x max_len limits the slots
            self.slots = max(1, min(self.slots, kv_capacity_tokens // self.max_seq_len))
        self.static_shapes = static_shapes
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv: SlotKVCache | None = None
        self._forward = self._forward_impl
        if compile:
            self._forward = torch.compile(self._forward_impl, mode="reduce-overhead", dynamic=False)
        self._lock = threading.Lock()          # held for each loop iteration and by update_weights
        self._cond = threading.Condition()     # guards _pending / _closed, wakes the loop
        self._pending: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}
        self._cached: dict[int, tuple[tuple[int, ...], float]] = {}   # free slot -> (fed tokens, last use)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "reused_tokens": 0, "copied_tokens": 0,
                      "decode_s": 0.0, "prefill_s": 0.0}

    # ------------------------------------------------------------------------------- Engine API
    def kv_capacity_tokens(self) -> int:
        """slots x max_seq_len: every slot reserves a full-length sequence (no paging)."""
        return self.slots * self.max_seq_len

    def kv_tokens_per_sequence(self) -> int:
        """What one sequence reserves: a whole slot (the scheduler admits by slots on HF engines)."""
        return self.max_seq_len

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; the engine needs at least one prompt token")
        room = self.max_seq_len - 1 - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_seq_len="
                             f"{self.max_seq_len}; shorten the prompt or raise max_seq_len")
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, min(params.max_new_tokens, room), loop.create_future(), loop,
                       make_generator(params.seed, self.device), StopChecker(self.tokenizer, params.stop_strings))
        with self._cond:
            if self._closed:
                raise EngineClosed("generate() on a closed HFEngine")
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf-engine-decode", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        state = load_state_dict_from_uri(weights) if isinstance(weights, str) else weights
        with self._lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("lm_head.weight")]   # tied embeddings
            if missing or unexpected:
                raise ValueError(f"update_weights: state_dict does not match the model (missing "
                                 f"{missing[:5]}, unexpected {list(unexpected)[:5]})")
            self._cached.clear()

    async def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------------------ decode loop
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._closed and not self._pending and not self._active:
                    self._cond.wait()
                if self._closed:
                    break
            try:
                with self._lock, torch.inference_mode():
                    self._admit()
                    if self._active:
                        self._decode_step()
            except Exception as e:   # noqa: BLE001 - a failed step fails its requests, not the engine
                for req in list(self._active.values()):
                    self._finish(req, error=e)
        err = EngineClosed("HFEngine closed")
        for req in list(self._active.values()) + list(self._pending):
            self._finish(req, error=err)
        self._pending.clear()

    def _store(self) -> SlotKVCache:
        if self._kv is None:
            cfg = self.model.config
            dtype = next(self.model.parameters()).dtype
            self._kv = SlotKVCache(cfg.num_hidden_layers, self.slots, cfg.num_key_value_heads, self.max_seq_len,
                                   self._head_dim, dtype, self.device)
        return self._kv

    def _take_slot(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, reusable prefix length) for a new request. The slot: a free one whose cached tokens
        share the longest prefix with the prompt, else an empty one, else the least recently used. If
        another slot (running or cached) shares a longer prefix, e.g. the same system prompt, its KV
        for that prefix is copied over: KV at a position depends only on the tokens up to it."""
        limit = len(prompt) - 1                      # at least one prompt token is fed

        def shared(toks) -> int:
            n, m = 0, min(len(toks), limit)
            while n < m and toks[n] == prompt[n]:
                n += 1
            return n

        free = [s for s in range(self.slots) if s not in self._active]
        lengths = {s: shared(self._cached[s][0]) for s in free if s in self._cached}
        target = max(lengths, key=lengths.get) if lengths and max(lengths.values()) > 0 else None
        if target is None:
            empty = [s for s in free if s not in self._cached]
            target = empty[0] if empty else min(free, key=lambda s: self._cached[s][1])
        reuse = lengths.get(target, 0)
        lengths.update({s: shared(r.fed_tokens()) for s, r in self._active.items()})
        src = max((s for s in lengths if s != target), key=lengths.get, default=None)
        self._cached.pop(target, None)
        if src is not None and lengths[src] > reuse:
            reuse = lengths[src]
            self._store().copy_slot(src, target, reuse)
            self.stats["copied_tokens"] += reuse
        return target, reuse

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._pending or len(self._active) >= self.slots:
                    return
                req = self._pending.popleft()
            if req.cancelled:
                continue
            slot, reuse = self._take_slot(req.prompt_ids)
            req.slot, req.kv_len = slot, reuse
            self._active[slot] = req
            t0 = time.perf_counter()
            suffix = req.prompt_ids[reuse:]
            view, pos, mask = self._store().prefill_view(slot, reuse, len(suffix))
            ids = torch.tensor([suffix], device=self.device)
            logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=view,
                                use_cache=True, logits_to_keep=1).logits[0, -1]
            req.kv_len = len(req.prompt_ids)
            self.stats["prefill_tokens"] += len(suffix)
            self.stats["reused_tokens"] += reuse
            self.stats["prefill_s"] += time.perf_counter() - t0
            self._append(req, logits)

    def _forward_impl(self, ids, pos, mask, view):
        return self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=view, use_cache=True).logits

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        store = self._store()
        rows = store.slots if self.static_shapes else max(self._active) + 1
        ids = torch.zeros(rows, 1, dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        active = torch.zeros(rows, dtype=torch.bool)
        reqs = list(self._active.values())
        for r in reqs:
            ids[r.slot, 0], positions[r.slot], active[r.slot] = r.out_ids[-1], r.kv_len, True
        view, pos, mask = store.decode_view(rows, positions.to(self.device), active.to(self.device),
                                            static=self.static_shapes)
        logits = self._forward(ids.to(self.device), pos, mask, view)[:, -1]
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(reqs)
        for r in reqs:
            r.kv_len += 1
            self._append(r, logits[r.slot])
        self.stats["decode_s"] += time.perf_counter() - t0

    def _append(self, req: _Request, logits: torch.Tensor) -> None:
        p = req.params
        token, logprob = sample_token(logits, p.temperature, p.top_p, req.generator)
        req.out_ids.append(token)
        req.out_logprobs.append(logprob)
        if token in p.stop_token_ids:
            self._finish(req, "stop")
        elif (s := req.stop.check(req.out_ids)) is not None:
            self._finish(req, "stop", s)
        elif len(req.out_ids) >= req.max_new:
            self._finish(req, "length")
        elif req.cancelled:
            self._finish(req, error=asyncio.CancelledError())

    def _finish(self, req: _Request, reason: str = "abort", stop_string: str | None = None,
                error: BaseException | None = None) -> None:
        if self._active.get(req.slot) is req:
            del self._active[req.slot]
            if error is None:
                self._cached[req.slot] = (tuple(req.fed_tokens()), time.monotonic())
        out = None if error is not None else GenerationOutput(tuple(req.out_ids), tuple(req.out_logprobs),
                                                              reason, stop_string)
        try:
            req.loop.call_soon_threadsafe(_resolve, req.future, out, error)
        except RuntimeError:      # the caller's event loop is gone; nobody is waiting
            pass


def _resolve(fut: asyncio.Future, out: GenerationOutput | None, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(out)
