"""RL problems: read a published dataset (parquet or JSONL rows `{id, problem, answer, ...}`), reject
malformed rows with a counted reason, and draw prompt batches from a seeded data cursor.

    problems, rejected = load_problems("file:///.../rl.parquet")
    idx = batch_indices(len(problems), seed=0, cursor=16, size=8)

Invariant: a batch depends only on (seed, cursor), the number of prompts the stage has consumed: prompt
`c` is item `c % n` of the permutation of epoch `c // n` (`numpy.random.default_rng([seed, epoch])`), so
a resumed stage that restores the cursor gets exactly the same next batch.

See docs/rl.md, "Choices, and where they depart from the paper or the reference code" (Data cursor).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass

import numpy as np

from rstar2_core import storage


@dataclass(frozen=True)
class RLProblem:
    id: str
    problem: str
    answer: str


def read_rows(url: str) -> list[dict]:
    data = storage.read_bytes(url)
    if url.endswith(".parquet") or data[:4] == b"PAR1":
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data)).to_pylist()
    rows = []
    for i, line in enumerate(data.decode("utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            rows.append({"__invalid__": f"line {i + 1}: {e.msg}"})
    return rows


def load_problems(url: str) -> tuple[list[RLProblem], dict[str, int]]:
    """Problems of a dataset at `url` and `{reason: count}` of rejected rows. Raises when none is usable."""
    problems: list[RLProblem] = []
    rejected: Counter[str] = Counter()
    seen: set[str] = set()
    for i, row in enumerate(read_rows(url)):
        if "__invalid__" in row:
            rejected["invalid_json"] += 1
            continue
        problem, answer = row.get("problem"), row.get("answer")
        if not isinstance(problem, str) or not problem.strip():
            rejected["missing_problem"] += 1
            continue
        if answer is None or not str(answer).strip():
            rejected["missing_answer"] += 1
            continue
        pid = str(row.get("id", f"row-{i}"))
        if pid in seen:
            rejected["duplicate_id"] += 1
            continue
        seen.add(pid)
        problems.append(RLProblem(pid, problem, str(answer).strip()))
    if not problems:
        raise ValueError(f"{url}: no usable RL problems (rejected: {dict(rejected)}); rows need non-empty "
                         "`problem` and `answer` fields (see data/curate.py)")
    return problems, dict(rejected)


def batch_indices(n: int, seed: int, cursor: int, size: int) -> list[int]:
    """Indices of prompts `cursor .. cursor + size - 1` of the seeded epoch-permuted stream over `n` problems."""
    if n < 1:
        raise ValueError("batch_indices: no problems")
    out: list[int] = []
    perms: dict[int, np.ndarray] = {}
    for c in range(cursor, cursor + size):
        epoch = c // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(int(perms[epoch][c % n]))
    return out
