"""Slot-based static KV cache for the HF engine's continuous batching.

Every sequence the engine is decoding owns one *slot*: a row of preallocated key/value tensors,
one pair per layer, each of shape (slots, kv_heads, max_len, head_dim). Rows have their own
lengths, so sequences of different lengths decode together: position ids are per row and a 4D
additive attention mask (rows, 1, q_len, kv_len) hides each row's unused tail.

The model sees a `SlotView` as its `cache` argument (transformers 5.x calls
`cache.update(key_states, value_states, layer_idx, kwargs=...)` in every attention layer and attends
over what it returns). A view either prefills one slot (`prefill_view`, q_len = new tokens) or
decodes one token for rows [0, rows) (`decode_view`); it writes the new keys/values into the slot
tensors and returns a strided *view* (no copy) of the rows and positions to attend over.

Design for CUDA graphs (issue 9): with `static=True` the decode view always spans all slots and the
full max_len, so every decode step has the same shapes; rows not decoding write to the scratch
position max_len - 1 and attend to position 0 only. The CPU default trims rows and length to what is
in use (much cheaper for a few long sequences). Departure from vLLM: no paging, so a slot reserves
max_len tokens whether or not the sequence gets that long; the engine's `kv_capacity_tokens` reports
exactly that (slots x max_len), which is what the KV-aware scheduler budgets against.

Memory: 2 x layers x slots x kv_heads x max_len x head_dim x dtype bytes, allocated with
`torch.empty` and zeroed slot by slot on first use, so slots never used cost no physical memory.
"""

from __future__ import annotations

import torch


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

    def ensure_initialised(self, rows: int) -> None:
        """Zero slots below `rows` that were never written. Masked positions are still multiplied by
        their (zero) attention weight, and 0 x NaN from uninitialised memory would poison the row."""
        if rows > self._initialised:
            for t in self.keys + self.values:
                t[self._initialised: rows].zero_()
            self._initialised = rows

    @property
    def scratch_pos(self) -> int:
        """Position written by rows that are not decoding; never part of a valid sequence."""
        return self.max_len - 1

    def prefill_view(self, slot: int, start: int, n: int) -> tuple[SlotView, torch.Tensor, torch.Tensor]:
        """Write positions [start, start + n) of `slot`; attend over [0, start + n) causally.

        Returns (cache view, position_ids (1, n), additive mask (1, 1, n, start + n)).
        """
        end = start + n
        self.ensure_initialised(slot + 1)
        if end > self.scratch_pos:
            raise ValueError(f"sequence of {end} tokens does not fit a slot of max_len {self.max_len} "
                             "(the last position is scratch); raise the engine's max_seq_len")
        pos = torch.arange(start, end, device=self.device)
        kv_pos = torch.arange(end, device=self.device)
        allowed = kv_pos[None, :] <= pos[:, None]                      # (n, end)
        mask = self._additive(allowed)[None, None]                     # (1, 1, n, end)
        view = SlotView(self, rows=slice(slot, slot + 1), write_rows=None, write_pos=slice(start, end),
                        kv_len=end)
        return view, pos[None, :], mask

    def decode_view(self, rows: int, positions: torch.Tensor, active: torch.Tensor, static: bool = False
                    ) -> tuple[SlotView, torch.Tensor, torch.Tensor]:
        """One decode step for slots [0, rows): row r writes its new token at `positions[r]`.

        positions: (rows,) long, the write position of each row (ignored where not active);
        active: (rows,) bool. Returns (cache view, position_ids (rows, 1), additive mask (rows, 1, 1, kv_len)).
        """
        if static:
            rows = self.slots
        self.ensure_initialised(rows)
        write = torch.where(active, positions, torch.full_like(positions, self.scratch_pos))
        kv_len = self.max_len if static else int(write[active].max().item()) + 1 if bool(active.any()) else 1
        kv_pos = torch.arange(kv_len, device=self.device)
        allowed = kv_pos[None, :] <= write[:, None]
        allowed = torch.where(active[:, None], allowed, kv_pos[None, :] == 0)
        mask = self._additive(allowed)[:, None, None, :]
        view = SlotView(self, rows=slice(0, rows), write_rows=torch.arange(rows, device=self.device),
                        write_pos=write, kv_len=kv_len)
        return view, write[:, None], mask

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of one slot into another (prefix reuse)."""
        self.ensure_initialised(max(src, dst) + 1)
        for k, v in zip(self.keys, self.values):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)


class SlotView:
    """What the model receives as `cache`: writes new keys/values, returns the slice to attend over."""

    def __init__(self, store: SlotKVCache, rows: slice, write_rows: torch.Tensor | None,
                 write_pos: slice | torch.Tensor, kv_len: int):
        self.store, self.rows, self.write_rows, self.write_pos, self.kv_len = store, rows, write_rows, write_pos, kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states: (rows, kv_heads, q_len, head_dim) -> the (rows, kv_heads, kv_len, head_dim) views."""
        k_store, v_store = self.store.keys[layer_idx], self.store.values[layer_idx]
        if self.write_rows is None:                     # prefill of one slot, contiguous positions
            k_store[self.rows, :, self.write_pos] = key_states
            v_store[self.rows, :, self.write_pos] = value_states
        else:                                           # decode: one position per row
            k_store[self.write_rows, :, self.write_pos] = key_states[:, :, 0]
            v_store[self.write_rows, :, self.write_pos] = value_states[:, :, 0]
        return k_store[self.rows, :, : self.kv_len], v_store[self.rows, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len
