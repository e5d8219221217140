"""`build_sft_dataset(cfg, out_url) -> DatasetRef`: the non-reasoning SFT set as JSONL conversations.

Sources: `cfg.data.synthetic` demonstrations (their code actually executed in the sandbox) plus the
files of `cfg.data.sft_sources` (JSONL or parquet, read through sft/formats.py). Rows are in the
`ChatFormat.render_trajectory` form (`problem` + `turns`) or, for general rows, `messages`, so the
trainer tokenizes them with whatever tokenizer the base model has.

Invariant: a malformed row is rejected with a reason and counted (`rejected/<reason>`), never half-read;
the file is written atomically and its sha256 is the digest. See docs/models-and-sft.md, "SFT data".

    rstar2 sft data --profile tiny --out file:///tmp/sft.jsonl
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from rstar2_core import storage
from rstar2_core.chat.tokens import REASON_OPEN
from rstar2_core.config import Config
from rstar2_core.results import DatasetRef
from rstar2_core.sft.formats import validate_messages


def validate_row(row: object) -> str | None:
    """None for a usable conversation row, else the rejection reason."""
    if not isinstance(row, dict):
        return "not_an_object"
    if not isinstance(row.get("problem"), str) or not row["problem"].strip():
        return "missing_problem"
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        return "missing_turns"
    for k, t in enumerate(turns):
        if not (isinstance(t, (list, tuple)) and len(t) == 2 and isinstance(t[0], str)):
            return "bad_turn"
        last = k == len(turns) - 1
        if last and t[1] is not None:
            return "last_turn_has_tool_results"
        if not last and not (isinstance(t[1], list) and t[1] and all(isinstance(x, str) for x in t[1])):
            return "missing_tool_results"
    if turns[0][0].startswith(REASON_OPEN):
        return "first_turn_repeats_reason_tag"
    if row.get("mask_answer") and ("\\boxed{" + str(row.get("answer") or "") + "}" not in turns[-1][0]
                                   or not row.get("answer")):
        return "mask_answer_without_its_boxed_answer"      # packing masks the answer inside that box
    return None


def _external_rows(url: str, counts: Counter) -> list[dict]:
    """The usable rows of one `data.sft_sources` file: the recipe's own form (`problem` + `turns`) as is,
    OpenAI `messages` and ShareGPT `conversations` rows normalized (rstar2_core/sft/formats.py); every
    other row rejected with its reason and counted (`rejected/<reason>`)."""
    from rstar2_core.data.sources import Reject, iter_rows, read_raw
    from rstar2_core.sft.formats import Rejected, normalize_row, row_format

    rows = []
    for i, row in enumerate(iter_rows(url, read_raw(url)[0])):
        if isinstance(row, Reject):
            counts[f"rejected/{row.reason}"] += 1
            continue
        rid = str(row.get("id", f"{url}#{i}"))
        try:
            fmt = row_format(row)
            if fmt != "rstar2":
                rows.append({"id": rid, **normalize_row(row), "source": url, "format": fmt})
                counts[f"format/{fmt}"] += 1
                continue
        except Rejected as e:
            counts[f"rejected/{e.reason}"] += 1
            continue
        reason = validate_row(row)
        if reason:
            counts[f"rejected/{reason}"] += 1
            continue
        rows.append({"id": rid, "problem": row["problem"], "turns": row["turns"],
                     "source": url, "answer": row.get("answer"), "failed_first": bool(row.get("failed_first")),
                     "mask_answer": bool(row.get("mask_answer"))})
        counts["format/rstar2"] += 1
    return rows


def build_sft_dataset(cfg: Config, out_url: str) -> DatasetRef:
    """Write the SFT conversations JSONL at `out_url` (+ `<out_url>.manifest.json`)."""
    from rstar2_core.chat import render_tool_result
    from rstar2_core.data.synthetic import demo_options, execute_requests, sft_demonstrations

    counts: Counter = Counter()
    rows: list[dict] = []
    syn = cfg.data.synthetic
    if syn.enabled and syn.n_sft:
        rejected: dict[str, int] = {}
        ro = cfg.rollout
        demos = sft_demonstrations(
            syn.seed, syn.n_sft, syn.fail_first_share, rejected=rejected, **demo_options(syn),
            execute=lambda reqs: execute_requests(reqs, cfg.sandbox),
            render=lambda r: render_tool_result(r, ro.tool_response_head_chars, ro.tool_response_tail_chars,
                                                ro.tool_response_max_chars, ro.tool_response_timing))
        counts.update({f"rejected/{k}": v for k, v in rejected.items()})
        for d in demos:
            row = d.to_json()
            row["source"] = "synthetic"
            rows.append(row)
        counts["synthetic"] = len(demos)
        counts["failed_first"] = sum(d.failed_first for d in demos)
        counts["direct"] = sum(d.direct for d in demos)
    for url in cfg.data.sft_sources:
        ext = _external_rows(url, counts)
        counts[f"source/{url}"] = len(ext)
        rows.extend(ext)
    if not rows:
        raise ValueError("the SFT set is empty: enable data.synthetic (n_sft > 0) or list JSONL/parquet files in "
                         f"data.sft_sources (rejections: {dict(counts)})")
    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()
    digest = hashlib.sha256(body).hexdigest()
    storage.write_bytes_atomic(out_url, body)
    manifest_url = out_url + ".manifest.json"
    storage.write_json_atomic(manifest_url, {"n_rows": len(rows), "digest": digest, "counts": dict(counts),
                                             "synthetic": syn.model_dump(), "sft_sources": cfg.data.sft_sources})
    return DatasetRef(url=out_url, digest=digest, n_rows=len(rows), manifest_url=manifest_url, counts=dict(counts))


def read_sft_rows(url: str) -> list[dict]:
    """Rows of an SFT JSONL written by `build_sft_dataset` (each validated again)."""
    rows = []
    for i, line in enumerate(storage.read_text(url).splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{url} line {i + 1}: not valid JSON ({e.msg}); rebuild it with build_sft_dataset") from e
        reason = validate_messages(row) if "messages" in row else validate_row(row)
        if reason:
            raise ValueError(f"{url} line {i + 1}: bad SFT row ({reason}); rebuild it with build_sft_dataset")
        rows.append(row)
    return rows
