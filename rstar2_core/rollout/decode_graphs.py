"""CUDA graphs of the HF engine's decode forward, one per (rows, attended length) bucket.

The decode forward reads only fixed device buffers (token ids, write positions, active flags, sized
for all slots) and writes into the fixed slot KV tensors, so per bucket it is recorded once (after
one eager warm-up run on a side stream) and replayed; all graphs share one memory pool.
Invariant: graphs are replayed one at a time and each output is consumed (sampled) before the next
replay; weights are only ever copied into the captured parameter tensors (`load_state_dict`).
Opt-in (`cuda_graphs=True`); `bench/gpu_check.py` checks it against `model.generate` on a GPU.
See docs/rollout.md, "HFEngine" (Fixed shapes and CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DecodeGraphs:
    """fn(rows, kv_len) -> logits (rows, vocab) reading fixed buffers; `run` replays its graph for the bucket."""

    def __init__(self, fn: Callable[[int, int], torch.Tensor], device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; pass cuda_graphs=False")
        self.fn, self.device = fn, device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run(self, rows: int, kv_len: int) -> torch.Tensor:
        key = (rows, kv_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, kv_len)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, rows: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.fn(rows, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a trainer on the same device) may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.fn(rows, kv_len)
        return graph, out
