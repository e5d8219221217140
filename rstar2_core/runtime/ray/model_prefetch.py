"""The remote model on every node that needs it, before the stage's actors start (`prefetch_models`).

Between the placement groups and the actors, `RayRuntime` runs one short task per node that will hold
trainer shards or engines: it puts the checkpoint in the node's cache under the entry's lock
(rstar2_core/models/node_cache.py; a node that has it is done at once), all bounded by
`cluster.model_download_timeout_s`. The actors then load from the node's disk, so
`cluster.placement_timeout_s` covers scheduling and construction only. Invariant: a failure or a timeout
stops every download (the task's process killed: the kernel drops its lock, the next download sweeps its
partial folder); a timeout raises ModelDownloadTimeout naming each late node and the bytes that arrived.
See docs/ray-runtime.md, "Start order and teardown".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rstar2_core import storage
from rstar2_core.runtime.layout import ClusterLayout
from rstar2_core.runtime.ray.errors import ModelDownloadTimeout

PROBE_TIMEOUT_S = 30.0
"""How long a timeout waits for a late node to say how many bytes arrived (then it reports 0)."""


def model_needs(layout: ClusterLayout, trainer_url: str | None, engine_urls: list[str] | None) -> dict[int, set[str]]:
    """{node index: the remote checkpoint URLs its actors load}: `trainer_url` on every node with trainer
    shards, `engine_urls[i]` on engine slot i's node (None: those actors load nothing of the store)."""
    needs: dict[int, set[str]] = {}
    for shard in layout.trainer_shards if trainer_url else ():
        needs.setdefault(shard.node, set()).add(trainer_url)
    for slot in layout.engines if engine_urls else ():
        needs.setdefault(slot.node, set()).add(engine_urls[slot.index])
    return {n: {u for u in urls if storage.to_local_path(u) is None} for n, urls in needs.items()
            if any(storage.to_local_path(u) is None for u in urls)}


def fetch_to_node(url: str, settings: dict) -> int:
    """Run on a node: the complete checkpoint `url` in this machine's cache (downloaded unless it is there),
    the entry `models.io.checkpoint_in_use` reads; returns its bytes. `settings`: the driver's
    `storage.s3_settings()`. Imports no torch: the task's worker process stays ~80 MB."""
    from rstar2_core.models.node_cache import cached_copy

    storage.configure_s3(**settings)
    if not storage.is_complete(url):
        raise FileNotFoundError(f"{url} is not a complete checkpoint (no {storage.COMPLETE_MARKER} marker): "
                                "the stage's actors cannot load it")
    with cached_copy(url, "checkpoints") as path:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def arrived_bytes(url: str, settings: dict) -> int:
    """Run on a node: bytes a download of `url` in progress there has written."""
    from rstar2_core.models.node_cache import partial_bytes

    storage.configure_s3(**settings)
    return partial_bytes(url, "checkpoints")


def _node_label(node_id: str) -> str:
    addr = next((n.get("NodeManagerAddress", "?") for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return f"node {node_id[:8]} ({addr})"


def _on(node_id: str) -> dict[str, Any]:
    return {"num_cpus": 0, "max_retries": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def prefetch_models(group: Any, needs: dict[int, set[str]], timeout_s: float,
                    fetch: Callable[[str, dict], int] = fetch_to_node) -> dict[str, float]:
    """Put each URL of `needs` (`model_needs`) in the cache of the node that holds the layout node's
    placement group (`group.pg(node)`), every node at once; returns {node label: seconds}. A download that
    fails raises its error; past `timeout_s` raises ModelDownloadTimeout. Either way every download still
    running is stopped first. `fetch` replaces `fetch_to_node` (tests pass a slow one)."""
    if not needs:
        return {}
    settings, task = storage.s3_settings(), ray.remote(fetch)
    refs: dict[Any, tuple[str, str]] = {}
    for node, urls in sorted(needs.items()):
        node_id = ray.util.placement_group_table(group.pg(node))["bundles_to_node_id"][0]
        for url in sorted(urls):
            refs[task.options(**_on(node_id)).remote(url, settings)] = (node_id, url)
    t0, done = time.monotonic(), {}
    pending = list(refs)
    try:
        while pending:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                ray.get(ref)                         # a failed download raises here (RayTaskError(cause))
                done[_node_label(refs[ref][0])] = time.monotonic() - t0
        if pending:
            late = {(refs[r][0], refs[r][1]) for r in pending}
            raise ModelDownloadTimeout(", ".join(sorted({u for _, u in late})), _late(late, settings), timeout_s)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return done


def _late(late: set[tuple[str, str]], settings: dict) -> dict[str, tuple[int, int]]:
    """{late node's label: (bytes arrived, bytes in all)} (arrived: 0 when the node does not answer)."""
    probe = ray.remote(arrived_bytes)
    asked = {(nid, url): probe.options(**_on(nid)).remote(url, settings) for nid, url in late}
    out = {}
    for (nid, url), ref in sorted(asked.items()):
        try:
            got = int(ray.get(ref, timeout=PROBE_TIMEOUT_S))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            got = 0
        label = _node_label(nid) + (f" {url}" if len({u for _, u in late}) > 1 else "")
        out[label] = (got, storage.dir_bytes(url))
    return out
