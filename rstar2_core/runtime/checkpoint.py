"""Publishing a policy checkpoint that a runtime's trainer (one process or many ranks) writes.

    url = publish_policy_checkpoint(url, rt.trainer, rt.tokenizer, extra={"rl_state.pt": b"..."}, meta={...})

The folder is filled through `storage.begin_dir` (a hidden sibling for local targets, the target
itself for object stores): the trainer writes the HF weights and each rank its own optimizer state
(`runtime/trainer_state.py`), the driver adds the tokenizer and its own extra files, and the
`_COMPLETE` marker is written last (`storage.commit_dir`). A crash before the marker leaves the previous
checkpoint the latest complete one.
"""

from __future__ import annotations

from typing import Any

from rstar2_core import storage


def publish_policy_checkpoint(url: str, trainer: Any, tokenizer: Any, extra: dict[str, bytes] | None = None,
                              meta: dict | None = None, optimizer: bool = True) -> str:
    """Publish the trainer's weights (+ optimizer state per rank unless `optimizer=False`), the
    tokenizer and `extra` files at `url`; returns `url`."""
    staging = storage.begin_dir(url)
    try:
        trainer.save(staging, optimizer=optimizer)
        with storage.staging_dir() as d:
            if tokenizer is not None:
                tokenizer.save_pretrained(str(d))
            for name, data in (extra or {}).items():
                if "/" in name or name.startswith(".") or name == storage.COMPLETE_MARKER:
                    raise ValueError(f"extra file name {name!r} must be a plain file name")
                (d / name).write_bytes(data)
            storage.upload_dir(d, staging)
        storage.commit_dir(staging, url, meta)
    except BaseException:
        storage.abort_dir(staging, url)
        raise
    return url
