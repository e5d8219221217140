"""Problem sources: read JSONL or parquet from any fsspec URL and map each row of a public layout
(`generic`, `dapo`, `openmathreasoning`, `project_euler`; `SourceConfig.layout`) to a `Candidate`
(id, problem, raw answer label, source).

Invariant: bad rows never crash a read: each is rejected with a reason (`invalid_json`,
`bad_encoding`, `missing_field:<name>`, ...) and counted by the caller; only a file in which *no* row
has the layout's fields raises `SourceLayoutError`, naming the expected and the found fields.
See docs/data-and-eval.md, "Curating problems" (the layouts table).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from rstar2_core import storage
from rstar2_core.errors import PicklableError


class SourceLayoutError(ValueError):
    """A file whose rows do not match the configured layout; the message lists the expected fields."""


@dataclass(frozen=True)
class Candidate:
    """One problem before filtering. `answer` is the raw label (normalised later by the filters)."""

    id: str
    problem: str
    answer: str
    source: str


@dataclass(frozen=True)
class SourceRead:
    """What one source gave: candidates, rejected-row reasons, and the file's sha256 digest."""

    name: str
    url: str
    layout: str
    digest: str
    n_rows: int
    candidates: tuple[Candidate, ...]
    rejected: Counter = field(default_factory=Counter)


class Reject(PicklableError, Exception):
    """Raised by adapters for one bad row; `reason` goes into the counts."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------- raw rows
def file_format(url: str) -> str:
    name = url.rsplit("/", 1)[-1].lower()
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return fmt
    raise ValueError(f"{url}: unknown file type; sources and benchmarks must be .jsonl (one JSON object "
                     "per line) or .parquet files")


def read_raw(url: str) -> tuple[bytes, str]:
    """(file bytes, sha256 hex). A missing file raises FileNotFoundError naming the URL."""
    if not storage.exists(url):
        raise FileNotFoundError(f"{url}: no such file; check the URL (local path, file://, s3://) in the config")
    data = storage.read_bytes(url)
    return data, hashlib.sha256(data).hexdigest()


def iter_rows(url: str, data: bytes) -> Iterator[dict | Reject]:
    """Rows of a JSONL/parquet file as dicts, or a `Reject` for a line that cannot be a row."""
    if file_format(url) == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        yield from table.to_pylist()
        return
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield Reject("bad_encoding")
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            yield Reject("invalid_json")
            continue
        yield row if isinstance(row, dict) else Reject("not_an_object")


@dataclass
class AdaptedRows:
    """What `adapt_rows` made of one file: the adapted items, the row count, rejects by reason, and
    every field name seen (for `check_layout`)."""

    items: list
    n_rows: int = 0
    rejected: Counter = field(default_factory=Counter)
    keys: set[str] = field(default_factory=set)


def adapt_rows(url: str, data: bytes, adapt: Callable[[dict, int], Any]) -> AdaptedRows:
    """`adapt(row, index)` over every row of the file; a row that cannot be parsed, or for which
    `adapt` raises `Reject`, is counted under its reason instead of stopping the read."""
    out = AdaptedRows(items=[])
    for i, row in enumerate(iter_rows(url, data)):
        out.n_rows += 1
        if isinstance(row, Reject):
            out.rejected[row.reason] += 1
            continue
        out.keys.update(row)
        try:
            out.items.append(adapt(row, i))
        except Reject as r:
            out.rejected[r.reason] += 1
    return out


def parquet_columns(data: bytes) -> list[str]:
    import pyarrow.parquet as pq

    return list(pq.read_schema(io.BytesIO(data)).names)


# ----------------------------------------------------------------------------------- field access
def pick(row: dict, names: tuple[str, ...], required: bool = True) -> Any:
    """First present (non-None) field among `names` (aliases of one field)."""
    for n in names:
        if row.get(n) is not None:
            return row[n]
    if required:
        raise Reject(f"missing_field:{names[0]}")
    return None


def text_field(row: dict, names: tuple[str, ...], required: bool = True) -> str | None:
    v = pick(row, names, required)
    if v is None:
        return None
    if not isinstance(v, str):
        raise Reject(f"wrong_type:{names[0]}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a JSON "\\ud800" escape
        raise Reject("bad_encoding") from None
    if "\ufffd" in v:  # the replacement character: the text was mis-decoded upstream
        raise Reject("bad_encoding")
    return v


def label_field(row: dict, names: tuple[str, ...]) -> str:
    v = pick(row, names)
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise Reject(f"wrong_type:{names[0]}")
    if isinstance(v, float):
        if not v.is_integer():
            return repr(v)
        v = int(v)
    s = str(v)
    if not s.strip():
        raise Reject("empty_answer")
    return text_field({"a": s}, ("a",)) or ""


def problem_field(row: dict, names: tuple[str, ...]) -> str:
    p = text_field(row, names) or ""
    if not p.strip():
        raise Reject("empty_problem")
    return p.strip()


def id_field(row: dict, names: tuple[str, ...], index: int) -> str:
    v = pick(row, names, required=False)
    if v is None:
        return str(index)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise Reject(f"wrong_type:{names[0]}")
    return str(v)


# --------------------------------------------------------------------------------------- adapters
PROBLEM = ("problem", "Problem", "question", "Question")
ANSWER = ("answer", "Answer")
ID = ("id", "ID", "Id", "unique_id", "problem_idx")

_DAPO_HEAD = re.compile(r"^\s*Solve the following math problem[^\n]*\n+", re.DOTALL)
_DAPO_TAIL = re.compile(r"\n+\s*(Remember to put your answer[^\n]*|Please output the final answer[^\n]*)\s*$", re.DOTALL)


def _generic(row: dict, i: int, name: str) -> Candidate:
    src = text_field(row, ("source", "data_source"), required=False) or name
    return Candidate(id_field(row, ID, i), problem_field(row, PROBLEM), label_field(row, ANSWER), src)


def _dapo(row: dict, i: int, name: str) -> Candidate:
    prompt = pick(row, ("prompt",))
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise Reject("wrong_type:prompt")
        text = text_field(users[-1], ("content",)) or ""
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise Reject("wrong_type:prompt")
    text = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text, count=1)).strip()
    if not text:
        raise Reject("empty_problem")
    rm = pick(row, ("reward_model",))
    if not isinstance(rm, dict):
        raise Reject("wrong_type:reward_model")
    answer = label_field(rm, ("ground_truth",))
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    rid = id_field(extra, ("index",), i)
    src = text_field(row, ("data_source",), required=False) or name
    return Candidate(rid, problem_field({"p": text}, ("p",)), answer, src)


_OMR_UNUSABLE = {"converted_proof", "no_answer_extracted"}


def _openmathreasoning(row: dict, i: int, name: str) -> Candidate:
    ptype = text_field(row, ("problem_type",), required=False)
    problem = problem_field(row, ("problem",))
    answer = label_field(row, ("expected_answer",))
    if ptype in _OMR_UNUSABLE:
        raise Reject(f"problem_type:{ptype}")
    src = text_field(row, ("problem_source",), required=False) or name
    return Candidate(id_field(row, ("id",), i), problem, answer, src)


def _project_euler(row: dict, i: int, name: str) -> Candidate:
    return Candidate(id_field(row, ("id", "ID", "Id"), i), problem_field(row, PROBLEM),
                     label_field(row, ANSWER), name)


Adapter = Callable[[dict, int, str], Candidate]
ADAPTERS: dict[str, Adapter] = {
    "generic": _generic,
    "dapo": _dapo,
    "openmathreasoning": _openmathreasoning,
    "project_euler": _project_euler,
}
LAYOUT_FIELDS: dict[str, str] = {
    "generic": "problem (or question), answer; optional id, source",
    "dapo": "prompt (chat messages with a user turn), reward_model.ground_truth; optional data_source, "
            "extra_info.index",
    "openmathreasoning": "problem, expected_answer; optional problem_type, problem_source",
    "project_euler": "id, problem, answer (or ID, Problem, Answer)",
}


def adapter_for(layout: str) -> Adapter:
    if layout not in ADAPTERS:
        raise ValueError(f"unknown source layout {layout!r}; valid layouts: {sorted(ADAPTERS)}")
    return ADAPTERS[layout]


def check_layout(url: str, layout: str, n_rows: int, n_ok: int, rejected: Counter, keys: set[str],
                 layouts: dict[str, str] | None = None) -> None:
    """Raise SourceLayoutError when rows exist but every parsable one lacks the layout's fields
    (`layouts`: layout -> description of its fields, for the message)."""
    layouts = layouts or LAYOUT_FIELDS
    missing = sum(v for k, v in rejected.items() if k.startswith("missing_field:"))
    parsable = n_rows - sum(rejected[k] for k in ("invalid_json", "bad_encoding", "not_an_object"))
    if n_ok == 0 and parsable > 0 and missing == parsable:
        raise SourceLayoutError(
            f"{url}: no row has the fields of layout {layout!r}: expected {layouts.get(layout, layout)}; "
            f"found fields {sorted(keys)}. Set the layout to the one matching the file "
            f"({sorted(layouts)}) or convert the file.")


def source_name(url: str, name: str | None) -> str:
    if name:
        return name
    stem = PurePosixPath(url.rsplit("://", 1)[-1]).name
    return stem.split(".", 1)[0] or "source"


def read_source(url: str, layout: str = "generic", name: str | None = None) -> SourceRead:
    """Read one source file into candidates; bad rows are counted in `rejected`, not raised."""
    adapt = adapter_for(layout)
    file_format(url)
    data, digest = read_raw(url)
    sname = source_name(url, name)
    rows = adapt_rows(url, data, lambda row, i: adapt(row, i, sname))
    out = [Candidate(f"{sname}/{c.id}", c.problem, c.answer, c.source) for c in rows.items]
    check_layout(url, layout, rows.n_rows, len(out), rows.rejected, rows.keys)
    return SourceRead(sname, url, layout, digest, rows.n_rows, tuple(out), rows.rejected)
