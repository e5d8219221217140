"""HFEngine: token-in/token-out generation over a transformers causal LM with continuous batching.

    engine = HFEngine(model, tokenizer, max_batch_size=32, max_seq_len=1024)
    out = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64, seed=1))
    await engine.close()

A background thread loops: admit waiting requests into free KV slots (`prefix.plan_slot`, batched
prefill), one decode step for every running slot (`kv_cache`, `shared_prefix`, `sampling`), retire
finished ones. Invariant: a request's tokens depend only on its own seed, logits and settings, never on
the batch; each loop iteration and `update_weights` hold `self._lock`, so weights never change mid-step.
See docs/rollout.md, "HFEngine".
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rstar2_core.rollout.kv_cache import MIN_BUCKET, SlotKVCache, bucket
from rstar2_core.rollout.model_call import ModelCall, check_model, disable_cudnn_attention
from rstar2_core.rollout.prefix import common_prefix, plan_slot
from rstar2_core.rollout.sampling import StopChecker, counter_uniform, sample_rows, seed_value
from rstar2_core.rollout.shared_prefix import MIN_SHARED, PrefixBlock, SharedPrefix, shared_prefix_attention
from rstar2_core.rollout.types import GenerationOutput, SamplingParams

# a request waits one admission round to copy a prefix from a request prefilled in this round only
# when that saves at least this many prefill tokens
_DEFER_MIN_GAIN = 8


class EngineClosed(RuntimeError):
    """The engine was closed while the request was waiting or running."""


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    seed: int
    stop: StopChecker
    prompt_np: np.ndarray = field(init=False)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    kv_len: int = 0          # tokens of prompt + output whose KV is in the slot
    cancelled: bool = False

    def __post_init__(self):
        self.prompt_np = np.asarray(self.prompt_ids, dtype=np.int64)

    def fed_tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt_np, np.asarray(self.out_ids, dtype=np.int64)])[: self.kv_len]


class HFEngine:
    """Continuous-batching engine over an HF causal LM (see module docstring). Implements `Engine`.

    max_batch_size: KV slots (sequences decoded together); max_seq_len: tokens per slot (prompt +
    output; default the model's max_position_embeddings); kv_capacity_tokens: a memory budget that
    lowers the slot count to what fits; max_prefill_tokens: padded tokens per prefill forward (more
    prompts per forward vs a longer stall of the decoding rows); static_shapes: power-of-two row and
    length buckets; cuda_graphs: CUDA only, record and replay each bucket's decode forward;
    shared_prefix: decode steps read a prompt prefix the running rows share once, not once per row
    (`shared_prefix.py`; None = on unless static_shapes, whose fixed shapes it would break; results equal
    the plain step within float rounding).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int = 64,
                 device: str | torch.device = "cpu", *, max_seq_len: int | None = None,
                 kv_capacity_tokens: int | None = None, static_shapes: bool = False, cuda_graphs: bool = False,
                 max_prefill_tokens: int = 4096, shared_prefix: bool | None = None):
        cfg = model.config
        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        check_model(model)
        disable_cudnn_attention()      # its plans are built per shape; the running rows change every step
        self._call = ModelCall(model)
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
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {self.device}; pass cuda_graphs=False")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.static_shapes, self.cuda_graphs = static_shapes or cuda_graphs, cuda_graphs
        if shared_prefix and self.static_shapes:
            raise ValueError("shared_prefix=True needs dynamic shapes (its step's shapes follow the shared length); "
                             "pass static_shapes=False and cuda_graphs=False, or shared_prefix=False")
        self.shared_prefix = (not self.static_shapes) if shared_prefix is None else bool(shared_prefix)
        self._block: PrefixBlock | None = None
        self.max_prefill_tokens = int(max_prefill_tokens)
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv: SlotKVCache | None = None
        self._graphs = None
        # per-slot state: host arrays (numpy views of staging tensors) mirrored to the device each step
        pin = self.device.type == "cuda"
        # token, pos, active, seed, count, shared (prompt tokens read from the prefix block)
        self._h_int = torch.zeros(6, self.slots, dtype=torch.int64, pin_memory=pin)
        self._h_flt = torch.zeros(2, self.slots, dtype=torch.float32, pin_memory=pin)  # temperature, top_p
        self._tok, self._pos, self._act, self._seed, self._cnt, self._shr = self._h_int.numpy()
        self._temp, self._top_p = self._h_flt.numpy()
        self._d_int = self._h_int if self.device.type == "cpu" else torch.zeros_like(self._h_int, device=self.device)
        self._d_flt = self._h_flt if self.device.type == "cpu" else torch.zeros_like(self._h_flt, device=self.device)
        self._lock = threading.Lock()          # held for each loop iteration and by update_weights
        self._cond = threading.Condition()     # guards _pending / _closed, wakes the loop
        self._pending: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}
        self._cached: dict[int, tuple[np.ndarray, float]] = {}   # free slot -> (fed tokens, last use)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "decode_rows": 0, "prefill_tokens": 0,
                      "prefill_forwards": 0, "prefill_padded_tokens": 0, "reused_tokens": 0, "copied_tokens": 0,
                      "compaction_moves": 0, "compaction_tokens": 0, "decode_s": 0.0, "prefill_s": 0.0,
                      "cuda_graphs": 0, "shared_prefix_steps": 0, "shared_prefix_unread_tokens": 0}

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
                       seed_value(params.seed), StopChecker(self.tokenizer, params.stop_strings))
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
        if isinstance(weights, str):
            from rstar2_core.rollout.weights import load_state_dict_from_uri  # fsspec, only for URIs

            weights = load_state_dict_from_uri(weights)
        state = weights
        with self._lock:
            # copies into the existing parameter tensors, so captured CUDA graphs stay valid
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("lm_head.weight")]   # tied embeddings
            if missing or unexpected:
                raise ValueError(f"update_weights: state_dict does not match the model (missing "
                                 f"{missing[:5]}, unexpected {list(unexpected)[:5]})")
            self._cached.clear()
            self._block = None               # its KV came from the old weights; running rows read their slots
            self._shr[:] = 0

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

    # ---------------------------------------------------------------------------------- admission
    def _admit(self) -> None:
        while len(self._active) < self.slots:
            group = self._claim_round()
            if not group:
                return
            self._prefill(group)

    def _claim_round(self) -> list[_Request]:
        """Give free slots to waiting requests in arrival order; one that would copy a longer prefix from
        a request of this round stays queued (at its place) for the next round."""
        with self._cond:
            queue, self._pending = list(self._pending), deque()
        group: list[_Request] = []
        keep: list[_Request] = []
        i = 0
        try:
            for i, req in enumerate(queue):
                if len(self._active) >= self.slots:
                    break
                if req.cancelled:
                    continue
                free = [s for s in range(self.slots) if s not in self._active]
                # running slots hold the KV of their prompt (enough for any other request's prefix)
                running = {s: r.prompt_np[: r.kv_len] for s, r in self._active.items()}
                plan = plan_slot(req.prompt_np, free, self._cached, running)
                limit = len(req.prompt_ids) - 1
                if any(common_prefix(g.prompt_np, req.prompt_np, limit) >= plan.reuse + _DEFER_MIN_GAIN
                       for g in group):
                    keep.append(req)
                    continue
                self._cached.pop(plan.slot, None)
                if plan.copy_from is not None:
                    self._store().copy_slot(plan.copy_from, plan.slot, plan.reuse)
                    self.stats["copied_tokens"] += plan.reuse
                req.slot, req.kv_len = plan.slot, plan.reuse
                self._active[plan.slot] = req
                group.append(req)
            else:
                i = len(queue)
        finally:   # what was not admitted goes back to the front of the queue, in order
            with self._cond:
                self._pending.extendleft(reversed(keep + queue[i:]))
        return group

    def _prefill(self, group: list[_Request]) -> None:
        """Prefill the prompt suffixes of `group` (already in their slots) and sample each one's first token."""
        group = sorted(group, key=lambda r: len(r.prompt_ids) - r.kv_len, reverse=True)
        i = 0
        while i < len(group):
            q = len(group[i].prompt_ids) - group[i].kv_len          # the longest suffix of this forward
            n = max(1, min(len(group) - i, self.max_prefill_tokens // q))
            # in slot order: rows that are a contiguous run of slots attend over a view, not a gathered copy
            self._prefill_forward(sorted(group[i: i + n], key=lambda r: r.slot), q)
            i += n
        if self.shared_prefix:
            self._share(group)

    def _share(self, group: list[_Request]) -> None:
        """Give the just-prefilled `group` its shared length with the prefix block. The block is (re)built
        from the group's first prompt when no running request reads at least MIN_SHARED tokens from it
        (at the start, after a weight update, when the prompts change): the KV of that prompt is in its
        slot now."""
        def share(r: _Request) -> int:
            n = self._block.shared_with(r.prompt_np)
            return n if n >= MIN_SHARED else 0

        if self._block is None or not any(share(r) for r in self._active.values()):
            src = group[0]
            if len(src.prompt_np) < MIN_SHARED:
                return
            keys, values = self._store().copy_prefix(src.slot, len(src.prompt_np))
            self._block = PrefixBlock(src.prompt_np.copy(), keys, values)
            group = list(self._active.values())        # every running request, against the new block
        for r in group:
            self._shr[r.slot] = share(r)

    def _prefill_forward(self, reqs: list[_Request], q: int) -> None:
        t0 = time.perf_counter()
        ids = np.zeros((len(reqs), q), dtype=np.int64)             # left padding
        for k, r in enumerate(reqs):
            suffix = r.prompt_np[r.kv_len:]
            ids[k, q - len(suffix):] = suffix
        starts = [r.kv_len for r in reqs]
        lengths = [len(r.prompt_ids) - r.kv_len for r in reqs]
        view, pos, mask = self._store().prefill_view([r.slot for r in reqs], starts, lengths)
        logits = self._call(torch.from_numpy(ids).to(self.device), pos, mask, view, logits_to_keep=1)[:, -1]
        seeds = torch.tensor([r.seed for r in reqs], device=self.device)
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=self.device)
        tokens, logprobs = sample_rows(logits, temps, top_p, counter_uniform(seeds, torch.zeros_like(seeds)),
                                       any(r.params.top_p < 1.0 for r in reqs))
        res = torch.stack((tokens.double(), logprobs.double())).cpu().numpy()   # the one device-to-host copy
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefill_padded_tokens"] += len(reqs) * q
        self.stats["reused_tokens"] += sum(starts)
        for k, r in enumerate(reqs):
            r.kv_len = len(r.prompt_ids)
            s = r.slot
            self._seed[s], self._temp[s], self._top_p[s] = r.seed, r.params.temperature, r.params.top_p
            self._act[s] = 1
            self._append(r, int(res[0, k]), float(res[1, k]))
        self.stats["prefill_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------- decode
    def _decode_forward(self, rows: int, kv_len: int, start: int = 0) -> torch.Tensor:
        """The decode forward: reads only the device state buffers, so a CUDA graph can replay it. With
        `start` > 0 the rows read their first `shared` positions from the prefix block and their slots
        from `start` on (`shared_prefix.py`)."""
        d = self._d_int
        if not start:
            view, pos, mask = self._store().decode_view(rows, kv_len, d[1, :rows], d[2, :rows].bool())
            return self._call(d[0, :rows, None], pos, mask, view)[:, -1]
        view, pos, mask, block_mask = self._store().decode_view_shared(
            rows, kv_len, start, d[1, :rows], d[2, :rows].bool(), d[5, :rows], len(self._block))
        with shared_prefix_attention(self.model):
            return self._call(d[0, :rows, None], pos, mask, view,
                              shared_prefix=SharedPrefix(self._block, block_mask))[:, -1]

    def _shared_start(self, slots: list[int], rows: int) -> int:
        """The step's shared start S (the smallest shared length of the running rows), or 0 for the plain
        step: the block path reads P + rows x (kv_len - S) positions instead of rows x kv_len, so it is
        taken when that is fewer and S >= MIN_SHARED."""
        if self._block is None:
            return 0
        start = int(self._shr[slots].min())
        if start < MIN_SHARED or len(self._block) >= rows * start:
            return 0
        self.stats["shared_prefix_steps"] += 1
        self.stats["shared_prefix_unread_tokens"] += rows * start - len(self._block)
        return start

    def _compact(self) -> None:
        """Keep the running requests in the lowest slots. A decode step computes rows [0, last active],
        idle slots below the last active one included, and every row attends over the longest row: an
        idle row costs as much as a running one. When idle rows exceed a quarter of the running ones,
        the highest running request moves into the lowest free slot, swapping KV with it (that slot's
        cached prefix moves up, so prefix reuse keeps working), until the running rows are [0, n)."""
        n = len(self._active)
        if max(self._active) + 1 - n <= n // 4:
            return
        store = self._store()
        while (high := max(self._active)) >= n:
            low = min(s for s in range(n) if s not in self._active)
            req = self._active.pop(high)
            cached = self._cached.pop(low, None)
            moved = len(cached[0]) if cached is not None else 0
            store.swap_slots(low, high, moved, req.kv_len)
            if cached is not None:
                self._cached[high] = cached
            for arr in (self._tok, self._pos, self._act, self._seed, self._cnt, self._shr, self._temp, self._top_p):
                arr[low] = arr[high]
            self._act[high] = self._shr[high] = 0
            req.slot = low
            self._active[low] = req
            self.stats["compaction_moves"] += 1
            self.stats["compaction_tokens"] += req.kv_len + moved

    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        self._compact()
        slots = sorted(self._active)
        rows = slots[-1] + 1
        kv_len = int(self._pos[slots].max()) + 1
        if self.static_shapes:
            rows, kv_len = bucket(rows, self.slots), bucket(kv_len, self.max_seq_len, MIN_BUCKET)
        store = self._store()
        store.ensure_initialised(rows)
        if self._d_int is not self._h_int:      # whole buffers: contiguous pinned copies, ~10 KB per step
            self._d_int.copy_(self._h_int, non_blocking=True)
            self._d_flt.copy_(self._h_flt, non_blocking=True)
        if self.cuda_graphs:
            if self._graphs is None:
                from rstar2_core.rollout.decode_graphs import DecodeGraphs

                self._graphs = DecodeGraphs(self._decode_forward, self.device)
            logits = self._graphs.run(rows, kv_len)
            self.stats["cuda_graphs"] = len(self._graphs.graphs)
        else:
            start = self._shared_start(slots, rows) if self.shared_prefix else 0
            logits = self._decode_forward(rows, kv_len, start)
        d, f = self._d_int, self._d_flt
        tokens, logprobs = sample_rows(logits, f[0, :rows], f[1, :rows], counter_uniform(d[3, :rows], d[4, :rows]),
                                       bool((self._top_p[slots] < 1.0).any()))
        res = torch.stack((tokens.double(), logprobs.double())).cpu().numpy()   # the one device-to-host copy
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(slots)
        self.stats["decode_rows"] += rows          # rows computed, idle slots below the last active one included
        for s in slots:
            req = self._active[s]
            req.kv_len += 1
            self._append(req, int(res[0, s]), float(res[1, s]))
        self.stats["decode_s"] += time.perf_counter() - t0

    def _append(self, req: _Request, token: int, logprob: float) -> None:
        p, s = req.params, req.slot
        req.out_ids.append(token)
        req.out_logprobs.append(logprob)
        self._tok[s], self._pos[s], self._cnt[s] = token, req.kv_len, len(req.out_ids)
        if token in p.stop_token_ids:
            self._finish(req, "stop")
        elif (hit := req.stop.check(req.out_ids)) is not None:
            self._finish(req, "stop", hit)
        elif len(req.out_ids) >= req.max_new:
            self._finish(req, "length")
        elif req.cancelled:
            self._finish(req, error=asyncio.CancelledError())

    def _finish(self, req: _Request, reason: str = "abort", stop_string: str | None = None,
                error: BaseException | None = None) -> None:
        if self._active.get(req.slot) is req:
            del self._active[req.slot]
            self._act[req.slot] = self._shr[req.slot] = 0
            if error is None:
                self._cached[req.slot] = (req.fed_tokens(), time.monotonic())
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
