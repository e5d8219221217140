"""A policy checkpoint as a runtime's trainer writes it: HF weights, one optimizer-state file per rank.

    url = publish_policy_checkpoint(url, rt.trainer, rt.tokenizer, extra={"rl_state.pt": b"..."}, meta={...})

Rank 0 writes the HF weights and each rank its own optimizer partition (`trainer/rank-00000.pt`, with
the world size it was written under) straight to storage; the driver adds the tokenizer and its extra
files. Invariant: `_COMPLETE` is written last, so a crash before it leaves the previous checkpoint the
latest complete one, and `read_rank_state` refuses a checkpoint written under another world size.
See docs/runtime.md, "Checkpoints a trainer writes".
"""

from __future__ import annotations

import io
from typing import Any

import torch

from rstar2_core import storage
from rstar2_core.models.io import publish_checkpoint


def publish_policy_checkpoint(url: str, trainer: Any, tokenizer: Any, extra: dict[str, bytes] | None = None,
                              meta: dict | None = None, optimizer: bool = True) -> str:
    """Publish the trainer's weights (+ each rank's optimizer state unless `optimizer=False`), the
    tokenizer and `extra` files at `url`; returns `url`."""
    return publish_checkpoint(url, lambda staging: trainer.save(staging, optimizer=optimizer), tokenizer,
                              extra, meta)


DIR = "trainer"
LEGACY_FILES = ("rl_state.pt", "trainer_state.pt")


def rank_file(checkpoint_url: str, rank: int) -> str:
    return storage.join(checkpoint_url, DIR, f"rank-{rank:05d}.pt")


def write_rank_state(staging_url: str, rank: int, world: int, backend_state: dict) -> int:
    """Write one rank's state (torch.save) into a checkpoint being published; returns its bytes. The state
    goes through a local file, not memory: the optimizer partition is the largest thing a rank saves, and
    two in-memory copies of it (a buffer and its bytes) doubled a rank's memory while saving."""
    with storage.staging_dir() as d:
        f = d / "rank-state.pt"
        torch.save({"rank": rank, "world_size": world, "backend": backend_state}, f)
        storage.write_file_atomic(rank_file(staging_url, rank), f)
        return f.stat().st_size


def saved_world_size(checkpoint_url: str) -> int | None:
    """How many ranks wrote trainer state into this checkpoint (None: no per-rank state)."""
    files = [u for u in _list(storage.join(checkpoint_url, DIR)) if u.rsplit("/", 1)[-1].startswith("rank-")]
    return len(files) or None


def _list(url: str) -> list[str]:
    fs, path = storage.fs_for(url)
    if not fs.exists(path):
        return []
    return sorted(str(p) for p in fs.ls(path, detail=False))


def read_rank_state(checkpoint_url: str, rank: int, world: int) -> dict[str, Any] | None:
    """The backend state rank `rank` of `world` saved in `checkpoint_url`, or None when the checkpoint
    has no trainer state (e.g. an SFT-free base model). Raises when it was written by another world size."""
    saved = saved_world_size(checkpoint_url)
    if saved is None:
        if world == 1:
            for name in LEGACY_FILES:
                legacy = storage.join(checkpoint_url, name)
                if storage.exists(legacy):
                    state = torch.load(io.BytesIO(storage.read_bytes(legacy)), weights_only=False)
                    if isinstance(state, dict) and "backend" in state:
                        return state["backend"]
        return None
    if saved != world:
        raise ValueError(f"{checkpoint_url} holds trainer state of {saved} rank(s) but this runtime has {world}: "
                         "ZeRO partitions the optimizer per rank, so a resume needs the same world size "
                         "(cluster.trainer_ranks / the layout) and ZeRO stage as the run that wrote it; to go on "
                         "with another size, start the stage again from its init checkpoint (delete its steps/)")
    state = torch.load(io.BytesIO(storage.read_bytes(rank_file(checkpoint_url, rank))), weights_only=False)
    if int(state.get("world_size", world)) != world or int(state.get("rank", rank)) != rank:
        raise ValueError(f"{rank_file(checkpoint_url, rank)} was written by rank {state.get('rank')} of "
                         f"{state.get('world_size')}, expected rank {rank} of {world}")
    return state["backend"]
