"""CUDA graphs of the HF engine's decode forward, one per (rows, attended length) bucket.

A decode step of a small batch is launch-bound on a GPU: hundreds of small kernels whose launch costs
more than their work (HF `generate` measured ~55 ms per step on an H200 at any batch size). The
engine's decode forward reads only fixed device buffers (token ids, write positions, active flags,
sized for all slots) and writes into the fixed slot KV tensors, so for a given (rows, kv_len) bucket
the whole forward, mask construction included, can be recorded once and replayed.

Recipe (torch.cuda.graphs docs, "Whole-network capture"): on first use of a bucket, run the step
once eagerly on a side stream (warm-up: lazy initialisations, cuBLAS workspaces), then record it
under `torch.cuda.graph(g, pool=...)`; later steps `g.replay()` and read the output tensor the
capture produced. All graphs share one memory pool: they are replayed one at a time and each
output is consumed (sampled) before the next replay. Warm-up and capture of a bucket happen with
the step's real inputs: the warm-up's writes into the KV cache are the same writes the replay then
repeats, so capturing mid-run changes nothing. Weight updates copy into the same parameter tensors
(`load_state_dict`), so captured graphs stay valid.

Not run in this project's CI (no GPU there): written against the documented API; `bench/gpu_check.py`
checks on a GPU that graph decoding gives the same greedy tokens as `model.generate`.
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
