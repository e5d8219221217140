"""bench/ipc_probe.py (the GPU probe of the packed IPC push) on the CPU: the consumer process rebuilds every
tensor from production's packed buckets (`pack_bucket`, several buckets) and from per-tensor handles, and
the checksums it compares would catch a moved or changed element."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _probe():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("bench.ipc_probe")


def test_the_checksums_see_a_swap_and_a_changed_bit():
    probe = _probe()
    t = torch.randn(64, dtype=torch.bfloat16)
    swapped, flipped = t.clone(), t.clone()
    swapped[[3, 40]] = t[[40, 3]]
    flipped.view(torch.int16)[7] ^= 1
    assert probe.checksums(t) == probe.checksums(t.clone())
    assert probe.checksums(swapped) != probe.checksums(t) != probe.checksums(flipped)


@pytest.mark.slow
def test_the_cpu_smoke_rebuilds_every_tensor_across_buckets():
    probe = _probe()
    res = probe.main(["--cpu", "--shape", "cpu-small", "--bucket-mib", "0", "--repeats", "1", "--json"])
    shapes = probe.state_shapes("cpu-small")
    assert res["packed"]["exact"] and res["per_tensor"]["exact"] and res["tensors"] == len(shapes) > 10
    assert res["bytes"] == sum(2 * torch.Size(s).numel() for _, s in shapes)
