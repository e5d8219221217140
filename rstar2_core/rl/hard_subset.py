"""The hard subset between RL stages: sample k rollouts per problem with a policy, drop problems it solves k/k.

    ref = select_hard_subset(cfg, 2, checkpoint_url=stage2_final, data_url=curated.url,
                             out_url="file:///.../hard-subset")
    # -> <out_url>/problems.parquet (the kept rows, all columns) + <out_url>/manifest.json

Invariant: a problem is dropped only when all k rollouts were graded correct; one with an infra-failed
rollout is kept, and more than `rl.max_infra_failure_share` of failures raises. Idempotent: an existing
manifest for the same checkpoint, data and k is returned without sampling again.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Hard subset).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import sys

from rstar2_core import storage
from rstar2_core.config import Config
from rstar2_core.errors import InfraFailureShareExceeded
from rstar2_core.models.io import load_tokenizer
from rstar2_core.progress import progress_bar
from rstar2_core.results import DatasetRef
from rstar2_core.rl.data import load_problems, read_rows
from rstar2_core.rl.stage import engine_seq_len, step_seed
from rstar2_core.rl.step import grade_groups, infra_failures
from rstar2_core.rollout.types import RolloutLimits
from rstar2_core.runtime import open_runtime


def _parquet_bytes(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def select_hard_subset(cfg: Config, stage_index: int, *, checkpoint_url: str, data_url: str,
                       out_url: str) -> DatasetRef:
    """Problems of `data_url` not solved k/k by the policy at `checkpoint_url` (see module docstring)."""
    if not 0 <= stage_index < len(cfg.rl.stages):
        raise ValueError(f"stage_index={stage_index} out of range 0..{len(cfg.rl.stages) - 1}")
    k = cfg.rl.stages[stage_index].hard_subset_k
    data_path, manifest_path = storage.join(out_url, "problems.parquet"), storage.join(out_url, "manifest.json")
    if storage.exists(manifest_path):
        m = storage.read_json(manifest_path)
        if (m.get("checkpoint_url"), m.get("source_url"), m.get("k")) == (checkpoint_url, data_url, k):
            return DatasetRef(m["url"], m["digest"], m["n_rows"], manifest_path, m["counts"])
    rows = [r for r in read_rows(data_url) if "__invalid__" not in r]
    problems, rejected = load_problems(data_url)
    by_id = {str(r.get("id", f"row-{i}")): r for i, r in enumerate(rows)}
    solved, infra_failed = asyncio.run(_count_solved(cfg, stage_index, checkpoint_url, problems, k))
    kept = [by_id[p.id] for p, s in zip(problems, solved) if s < k]
    counts = {"input": len(problems), "rejected_rows": rejected, "solved_all": sum(s == k for s in solved),
              "kept": len(kept), "k": k, "infra_failed": infra_failed}
    if not kept:
        raise ValueError(f"the policy at {checkpoint_url} solves all {len(problems)} problems {k}/{k}: the hard "
                         "subset is empty; raise hard_subset_k or train this stage on dataset = \"curated\"")
    data = _parquet_bytes(kept)
    digest = hashlib.sha256(data).hexdigest()
    storage.write_bytes_atomic(data_path, data)
    storage.write_json_atomic(manifest_path, {"url": data_path, "digest": digest, "n_rows": len(kept),
                                              "counts": counts, "checkpoint_url": checkpoint_url,
                                              "source_url": data_url, "k": k, "stage_index": stage_index})
    return DatasetRef(data_path, digest, len(kept), manifest_path, counts)


async def _count_solved(cfg: Config, stage_index: int, checkpoint_url: str, problems, k: int
                        ) -> tuple[list[int], int]:
    """Per problem: rollouts out of k that are correct and not infra-failed, sampled on the runtime's
    engines; and how many rollouts failed for infrastructure reasons (module docstring)."""
    from rstar2_core.chat import ChatFormat
    from rstar2_core.rollout import rollout_groups

    stage = cfg.rl.stages[stage_index]
    chat = ChatFormat(load_tokenizer(checkpoint_url), with_tools=True)
    limits = RolloutLimits.from_config(cfg.rollout, stage.max_turns, stage.max_response_tokens, cfg.rl.temperature)
    chunk = max(1, cfg.rl.prompts_per_step)
    out: list[int] = []
    failed = total = 0
    async with open_runtime(cfg, policy_url=checkpoint_url,
                            max_model_len=engine_seq_len(chat, problems, stage.max_response_tokens)) as rt:
        for start in progress_bar(range(0, len(problems), chunk), desc=f"hard subset (k={k})", unit="batch",
                                  file=sys.stderr):
            part = problems[start:start + chunk]
            groups = await rollout_groups(rt.engines, rt.sandbox, chat, [p.problem for p in part], k, limits,
                                          seed=step_seed(cfg.rl.seed, -1 - start), scheduler=cfg.rollout.scheduler,
                                          group_affinity=cfg.rollout.group_affinity)
            grades = grade_groups(rt.grader, groups, [p.answer for p in part])
            infra = infra_failures(groups, grades)
            n = sum(len(g) for g in groups)
            failed, total = failed + int(infra["infra/failed"]), total + n
            if failed > cfg.rl.max_infra_failure_share * total:
                raise InfraFailureShareExceeded(
                    f"hard subset: {failed} of the {total} rollouts so far failed for infrastructure reasons "
                    f"(this batch: engine errors {infra['infra/engine_errors']:.0f}, sandbox errors "
                    f"{infra['infra/sandbox_errors']:.0f}, grader timeouts {infra['infra/grader_timeouts']:.0f}, "
                    f"grader errors {infra['infra/grader_errors']:.0f}), above rl.max_infra_failure_share = "
                    f"{cfg.rl.max_infra_failure_share}: problems it could not judge would all be kept. A retry "
                    "samples again; if it repeats, check the engines, the sandbox pool and eval.grader_timeout_s")
            for group, rs in zip(groups, grades.rewards):
                # an infra-failed rollout is not a success: the problem cannot reach k/k
                out.append(sum(1 for t, r in zip(group, rs) if r > 0 and not t.infra_failed))
    return out, failed
