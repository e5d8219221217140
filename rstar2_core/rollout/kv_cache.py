"""Slot-based static KV cache for the HF engine's continuous batching.

Every sequence being decoded owns one *slot*: a row of preallocated key/value tensors, per layer of
shape (slots, kv_heads, max_len, head_dim). The model sees a `SlotView` as its cache: `prefill_view`
prefills a batch of slots, `decode_view` decodes one token for slots [0, rows), `decode_view_shared`
does that reading a shared prefix block; each writes the new keys/values into the slots and returns
what to attend over, with an additive mask (none for fresh prompts of equal length: SDPA's flash path).
Invariant: rows not decoding write only to the scratch position max_len - 1 (never part of a
sequence), and a slot is zeroed before first use (0 x uninitialised NaN would poison its row).
See docs/rollout.md, "The slot KV cache (`kv_cache.py`)".
"""

from __future__ import annotations

import torch

MIN_BUCKET = 64


def bucket(n: int, limit: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor), capped at `limit` (fixed shapes for CUDA graphs)."""
    b = max(floor, 1)
    while b < n:
        b *= 2
    return min(b, limit)


class SlotKVCache:
    """Static per-slot key/value storage. Shapes: `keys[l]`, `values[l]`: (slots, kv_heads, max_len, head_dim)."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if slots < 1 or max_len < 2:
            raise ValueError(f"SlotKVCache needs slots >= 1 and max_len >= 2 (got {slots}, {max_len})")
        shape = (slots, kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.max_len, self.dtype, self.device = slots, max_len, dtype, torch.device(device)
        self._initialised = 0      # slots [0, _initialised) hold finite values
        self._arange = torch.arange(max_len, device=self.device)

    def ensure_initialised(self, rows: int) -> None:
        """Zero slots below `rows` that were never written (see the module docstring)."""
        if rows > self._initialised:
            for t in self.keys + self.values:
                t[self._initialised: rows].zero_()
            self._initialised = rows

    @property
    def scratch_pos(self) -> int:
        """Position written by rows that are not decoding; never part of a valid sequence."""
        return self.max_len - 1

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def prefill_view(self, slots: list[int], starts: list[int], lengths: list[int]
                     ) -> tuple[SlotView, torch.Tensor, torch.Tensor | None]:
        """Prefill `lengths[i]` new tokens into `slots[i]` at positions [starts[i], starts[i] + lengths[i]).

        Inputs are left-padded to q = max(lengths): row i's tokens sit at query indices [q - lengths[i], q),
        so every row's last token is at index q - 1 (`logits_to_keep=1`). Returns (cache view,
        position_ids (n, q), mask (n, 1, q, kv_len) or None when plain causal attention is exact).
        """
        n, q = len(slots), max(lengths)
        kv_len = max(s + m for s, m in zip(starts, lengths))
        if kv_len > self.scratch_pos:
            raise ValueError(f"sequence of {kv_len} tokens does not fit a slot of max_len {self.max_len} "
                             "(the last position is scratch); raise the engine's max_seq_len")
        self.ensure_initialised(max(slots) + 1)
        dev = self.device
        start_t = torch.tensor(starts, device=dev)[:, None]
        pad = q - torch.tensor(lengths, device=dev)[:, None]
        idx = self._arange[:q][None, :]
        valid = idx >= pad                                                   # (n, q)
        pos = start_t + idx - pad
        write = torch.where(valid, pos, self.scratch_pos)
        contiguous = slots == list(range(slots[0], slots[0] + n))
        rows = slice(slots[0], slots[0] + n) if contiguous else torch.tensor(slots, device=dev)
        view = SlotView(self, rows, torch.tensor(slots, device=dev)[:, None], write, kv_len, prefill=True)
        if all(s == 0 for s in starts) and all(m == q for m in lengths):
            return view, pos, None                                          # q == kv_len, causal: is_causal
        kv = self._arange[:kv_len][None, None, :]
        allowed = torch.where(valid[:, :, None], kv <= pos[:, :, None], kv == 0)   # (n, q, kv_len)
        return view, torch.where(valid, pos, 0), self._additive(allowed[:, None])

    def decode_view(self, rows: int, kv_len: int, write_pos: torch.Tensor, active: torch.Tensor
                    ) -> tuple[SlotView, torch.Tensor, torch.Tensor]:
        """One decode step for slots [0, rows), attending over positions [0, kv_len).

        write_pos: (rows,) long, where each row writes its new token (its length so far; ignored where
        not active); active: (rows,) bool. Only device ops on these tensors, no host sync: a CUDA
        graph can capture it. Returns (cache view, position_ids (rows, 1), mask (rows, 1, 1, kv_len)).
        """
        write = torch.where(active, write_pos, self.scratch_pos)
        kv = self._arange[:kv_len][None, :]
        allowed = torch.where(active[:, None], kv <= write[:, None], kv == 0)
        view = SlotView(self, slice(0, rows), self._arange[:rows], write, kv_len, prefill=False)
        return view, write[:, None], self._additive(allowed[:, None, None, :])

    def decode_view_shared(self, rows: int, kv_len: int, start: int, write_pos: torch.Tensor, active: torch.Tensor,
                           shared: torch.Tensor, block_len: int
                           ) -> tuple[SlotView, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`decode_view` for a step whose rows attend their first `shared[r]` positions through a prefix
        block (`shared_prefix.py`) and their own slot over [start, kv_len) (start <= every active row's
        shared length). Returns (view returning the own positions [start, kv_len), position_ids (rows, 1),
        own-slot mask (rows, 1, 1, kv_len - start), block mask (rows, 1, 1, block_len)): row r attends
        block positions < shared[r] and own positions in [shared[r], its write position]; a row not
        decoding attends own position `start` only (finite, never NaN)."""
        write = torch.where(active, write_pos, self.scratch_pos)
        shared = torch.where(active, shared, 0)
        kv = self._arange[start:kv_len][None, :]
        own = torch.where(active[:, None], (kv >= shared[:, None]) & (kv <= write[:, None]), kv == start)
        pre = self._arange[:block_len][None, :] < shared[:, None]
        view = SlotView(self, slice(0, rows), self._arange[:rows], write, kv_len, prefill=False, start=start)
        return view, write[:, None], self._additive(own[:, None, None, :]), self._additive(pre[:, None, None, :])

    def copy_prefix(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first `length` positions of `slot`, per layer: (keys, values), each (1, kv_heads, length, D)."""
        return ([k[slot: slot + 1, :, :length].clone() for k in self.keys],
                [v[slot: slot + 1, :, :length].clone() for v in self.values])

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of one slot into another (prefix reuse)."""
        self.ensure_initialised(max(src, dst) + 1)
        for k, v in zip(self.keys, self.values):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def swap_slots(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Exchange the first len_a positions of slot a with the first len_b of slot b (compaction)."""
        self.ensure_initialised(max(a, b) + 1)
        for t in self.keys + self.values:
            keep = t[a, :, :len_a].clone()
            t[a, :, :len_b] = t[b, :, :len_b]
            t[b, :, :len_a] = keep


class SlotView:
    """What the model receives as its cache: writes new keys/values, returns the slice to attend over.

    rows: the slots attended (a slice, or an index tensor that gathers); write_rows / write_pos:
    prefill (n, 1) / (n, q), decode (rows,) / (rows,) indices of the new keys' destinations.
    """

    is_compileable = False

    def __init__(self, store: SlotKVCache, rows: slice | torch.Tensor, write_rows: torch.Tensor,
                 write_pos: torch.Tensor, kv_len: int, prefill: bool, start: int = 0):
        self.store, self.rows, self.write_rows, self.write_pos = store, rows, write_rows, write_pos
        self.kv_len, self.prefill, self.q_offset, self.start = kv_len, prefill, 0, start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states: (rows, kv_heads, q_len, head_dim) -> (rows, kv_heads, kv_len - start, head_dim)."""
        k_store, v_store = self.store.keys[layer_idx], self.store.values[layer_idx]
        if self.prefill:      # destinations (n, q): the values go in as (n, q, kv_heads, head_dim)
            k_store[self.write_rows, :, self.write_pos] = key_states.transpose(1, 2)
            v_store[self.write_rows, :, self.write_pos] = value_states.transpose(1, 2)
        else:                 # one position per row
            k_store[self.write_rows, :, self.write_pos] = key_states[:, :, 0]
            v_store[self.write_rows, :, self.write_pos] = value_states[:, :, 0]
        return k_store[self.rows, :, self.start: self.kv_len], v_store[self.rows, :, self.start: self.kv_len]

    # the cache methods transformers' mask builder calls when it gets no mask (5.17 - 5.24)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.q_offset

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_len, 0
