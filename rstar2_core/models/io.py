"""Checkpoint read/write: HF checkpoint folders at fsspec URLs, published atomically.

A checkpoint is a normal HF folder (config.json, model.safetensors, tokenizer files) plus optional
extra files (trainer state, RNG) and a `_COMPLETE` marker written last (its JSON body holds `meta`).
`publish_checkpoint` is the one writer of that layout: `save_checkpoint` (a model in this process) and
`runtime.checkpoint.publish_policy_checkpoint` (a runtime's trainer) both go through it.

Invariant: readers ignore folders without the marker, so a crash mid-write leaves the previous
checkpoint the latest complete one. Remote checkpoints are read once per machine into a bounded cache
(node_cache.py). See docs/models-and-sft.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from rstar2_core import storage
from rstar2_core.models.node_cache import cached_copy

FROM_PRETRAINED_LOCK = threading.Lock()
"""Held around every `from_pretrained` in this process: transformers' loader is not thread-safe (it
builds the model on the meta device through process-global state, so two threads loading at once can
leave one model with meta tensors: "Cannot copy out of meta tensor", transformers issue #41782). Prefect
runs independent tasks (an evaluation beside the next stage's hard-subset sampling) in threads."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".npz")
"""Files `load_tokenizer` never downloads (weights and trainer state, whatever their folder)."""


def _is_tokenizer_file(rel: str) -> bool:
    """A top-level checkpoint file that is not weights: tokenizer files, config.json, the marker."""
    return "/" not in rel and not rel.endswith(WEIGHT_SUFFIXES)


@contextlib.contextmanager
def checkpoint_in_use(checkpoint_url: str) -> Iterator[Path]:
    """The local folder of a complete checkpoint, held for the `with` block: a remote one is this machine's
    cached copy (node_cache.py: downloaded once per machine), which the cache's bound never evicts while
    a process holds it."""
    _require_complete(checkpoint_url)
    local = storage.to_local_path(checkpoint_url)
    if local is not None:
        yield local
        return
    with cached_copy(checkpoint_url, "checkpoints") as path:
        yield path


def local_checkpoint_dir(checkpoint_url: str) -> Path:
    """Local folder holding a complete checkpoint (a remote one downloaded once per machine), not held after
    this returns: a cached copy may be evicted once another download needs its room (`checkpoint_in_use`
    holds it)."""
    with checkpoint_in_use(checkpoint_url) as path:
        return path


def _require_complete(checkpoint_url: str) -> None:
    if not storage.is_complete(checkpoint_url):
        raise FileNotFoundError(f"{checkpoint_url} is not a complete checkpoint (no {storage.COMPLETE_MARKER} "
                                "marker): it is missing or was interrupted mid-write; use latest_complete() "
                                "on its parent folder to find the last good one")


def load_model_and_tokenizer(checkpoint_url: str, dtype=None, device: str = "cpu"):
    """(model in eval mode on `device`, tokenizer) from a complete HF checkpoint URL or local folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with checkpoint_in_use(checkpoint_url) as path, FROM_PRETRAINED_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_resolve_dtype(dtype) or "auto")
        tok = AutoTokenizer.from_pretrained(str(path))
    model.to(device).eval()
    return model, tok


def load_tokenizer(checkpoint_url: str):
    """The tokenizer saved in a complete checkpoint. Of a remote checkpoint only its top-level files that
    are not weights are downloaded (`cache/tokenizers`): the driver of a 14B run reads megabytes, not the
    ~28 GB of weights."""
    from transformers import AutoTokenizer

    _require_complete(checkpoint_url)
    local = storage.to_local_path(checkpoint_url)
    if local is not None:
        with FROM_PRETRAINED_LOCK:
            return AutoTokenizer.from_pretrained(str(local))
    with cached_copy(checkpoint_url, "tokenizers", _is_tokenizer_file) as path, FROM_PRETRAINED_LOCK:
        return AutoTokenizer.from_pretrained(str(path))


def read_extra(checkpoint_url: str, name: str) -> bytes:
    """One extra file saved with `save_checkpoint(extra={name: ...})`."""
    return storage.read_bytes(storage.join(checkpoint_url, name))


def read_meta(checkpoint_url: str) -> dict:
    """The `meta` dict stored in the checkpoint's `_COMPLETE` marker."""
    return storage.read_json(storage.join(checkpoint_url, storage.COMPLETE_MARKER))


def publish_checkpoint(out_url: str, write_weights, tokenizer=None, extra: dict[str, bytes] | None = None,
                       meta: dict | None = None) -> str:
    """The one checkpoint publisher: `write_weights(staging_url)` writes the weights (one process, or every
    trainer rank its share), then the tokenizer and `extra` files are added and the `_COMPLETE` marker
    (with `meta`) is written last (`storage.begin_dir` / `commit_dir`). A failure drops the staging folder
    and leaves the previous checkpoint at `out_url`, if any, the latest complete one. Returns `out_url`."""
    for name in extra or {}:
        if "/" in name or name.startswith(".") or name == storage.COMPLETE_MARKER:
            raise ValueError(f"extra file name {name!r} must be a plain file name")
    staging = storage.begin_dir(out_url)
    try:
        write_weights(staging)
        with storage.staging_dir() as d:
            if tokenizer is not None:
                tokenizer.save_pretrained(str(d))
            for name, data in (extra or {}).items():
                (d / name).write_bytes(data)
            storage.upload_dir(d, staging)
        storage.commit_dir(staging, out_url, meta)
    except BaseException:
        storage.abort_dir(staging, out_url)
        raise
    return out_url


def publish_copy(src_url: str, out_url: str, extra: dict[str, bytes] | None = None,
                 meta: dict | None = None) -> str:
    """Publish at `out_url` the complete checkpoint `src_url` (weights, trainer state, tokenizer) with its
    own `extra` files and `meta`, as `publish_checkpoint` would, but by `storage.copy_dir` (a server-side
    copy, hard links locally): nothing is gathered, serialized or uploaded again. Returns `out_url`."""
    if not storage.is_complete(src_url):
        raise ValueError(f"{src_url} is not a complete checkpoint: nothing to publish a copy of")
    return publish_checkpoint(
        out_url, lambda staging: storage.copy_dir(src_url, staging, {storage.COMPLETE_MARKER, *(extra or {})}),
        None, extra, meta)


def write_hf_folder(save, url: str) -> None:
    """Run `save(local_dir)` (an HF `save_pretrained`-style writer) so its files land at `url`: straight
    into a local folder, or through a local staging folder uploaded to a remote one."""
    local = storage.to_local_path(url)
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
        save(local)
        return
    with storage.staging_dir() as d:
        save(d)
        storage.upload_dir(d, url)


def save_checkpoint(model, tokenizer, out_url: str, extra: dict[str, bytes] | None = None,
                    meta: dict | None = None) -> str:
    """Publish model (+ tokenizer, + extra files) at `out_url` through `publish_checkpoint`; returns `out_url`.

    `model` may be an nn.Module with `save_pretrained` or a `TrainBackend` (its `save_hf` is used)."""
    if hasattr(model, "save_hf"):
        save = model.save_hf
    else:
        def save(d):
            model.save_pretrained(str(d), safe_serialization=True)
    return publish_checkpoint(out_url, lambda staging: write_hf_folder(save, staging), tokenizer, extra, meta)


_NUM = re.compile(r"(\d+)$")


def _order(url: str) -> tuple[int, str]:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    m = _NUM.search(name)
    return (int(m.group(1)) if m else -1, name)


def latest_complete(dir_url: str) -> str | None:
    """URL of the complete sub-folder of `dir_url` with the highest trailing step number (then name);
    None when there is none. Hidden (temp) folders and folders without `_COMPLETE` are ignored."""
    cands = [u for u in storage.list_dirs(dir_url)
             if not u.rstrip("/").rsplit("/", 1)[-1].startswith(".") and storage.is_complete(u)]
    return max(cands, key=_order) if cands else None
