"""What an operator uploads before the production run, made small for the rehearsal: every object the
production profile names, in its published layout, at the URL the profile gives it.

- s3://rstar2-models/SmolLM2-135M-Instruct-recipe-format: the base model (rehearsal_model.py);
- s3://rstar2-data/raw/ (DAPO-Math, OpenMathReasoning, Project Euler), s3://rstar2-data/sft/ (function
  calling, instruction following, chat) and s3://rstar2-data/bench/ (AIME 2024/2025, HMMT Feb 2025,
  MATH-500, GPQA-Diamond), each in its source's own file format and fields (`datasets`).
Invariant: the problems are small integer arithmetic worded differently per set, with no 8-gram shared
with a benchmark (curation keeps them), easy enough that a 135M model answers some, so the label check,
RoC and the evaluation have signal. See docs/rehearsal.md, "Rehearsing the production profile".
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

from rstar2_cli.rehearsal_model import DAPO_HEAD, DAPO_TAIL
from rstar2_core import storage


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _pairs(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(n)]


def datasets(n: int = 24, n_bench: int = 6) -> dict[str, bytes]:
    """{url: file bytes} of every data file the production profile names (see the module docstring)."""
    dapo = [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"role": "user", "content": f"{DAPO_HEAD}What is {a} plus {b}?{DAPO_TAIL}"}],
             "reward_model": {"ground_truth": str(a + b), "style": "rule-lapse"},
             "extra_info": {"index": f"dapo-{i:04d}"}} for i, (a, b) in enumerate(_pairs(1, n))]
    omr = [{"problem": f"Compute {a} times {b}.", "expected_answer": f"\\boxed{{{a * b}}}",
            "problem_type": "has_answer_extracted", "problem_source": "aops_c4_high_school_math",
            "generated_solution": "...", "id": f"omr-{i}"} for i, (a, b) in enumerate(_pairs(2, n))]
    euler = [{"id": i + 1, "problem": f"Find {a + b} minus {b}.", "answer": str(a)}
             for i, (a, b) in enumerate(_pairs(3, n))]
    calc = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    fc = [{"id": f"fc-{i}", "tools": [calc], "messages": [
        {"role": "user", "content": f"Please add {a} and {b} with the tool."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}]},
        {"role": "tool", "tool_call_id": "c0", "content": str(a + b)},
        {"role": "assistant", "content": f"The sum is {a + b}."}]} for i, (a, b) in enumerate(_pairs(4, n))]
    ifollow = [{"id": f"if-{i}", "messages": [
        {"role": "user", "content": f"Reply with the number {a} in words, in lower case, and nothing else."},
        {"role": "assistant", "content": ["one", "two", "three", "four", "five", "six", "seven", "eight",
                                          "nine"][a - 1]}]} for i, (a, _) in enumerate(_pairs(5, n))]
    chat = [{"conversations": [{"from": "human", "value": f"Hi! Is {a} bigger than {b}?"},
                               {"from": "gpt", "value": "Yes." if a > b else "No."}]}
            for a, b in _pairs(6, n)]
    aime = [{"id": f"2024-{i}", "problem": f"Add {a} and {b}.", "answer": str(a + b)}
            for i, (a, b) in enumerate(_pairs(7, n_bench))]
    aime25 = [{"id": f"2025-{i}", "problem": f"Take the sum of {a} and {b}.", "answer": str(a + b)}
              for i, (a, b) in enumerate(_pairs(8, n_bench))]
    hmmt = [{"problem_idx": i + 1, "problem": f"Multiply {a} by {b}.", "answer": str(a * b)}
            for i, (a, b) in enumerate(_pairs(9, n_bench))]
    math500 = [{"problem": f"Subtract {b} from {a + b}.", "answer": str(a), "unique_id": f"test/arith/{i}.json",
                "subject": "Prealgebra", "level": 1} for i, (a, b) in enumerate(_pairs(10, n_bench))]
    gpqa = [{"Record ID": f"rec{i:03d}", "Question": f"Which number equals {a} plus {b}?",
             "Correct Answer": str(a + b), "Incorrect Answer 1": str(a + b + 1), "Incorrect Answer 2": str(a + b + 2),
             "Incorrect Answer 3": str(a + b + 3)} for i, (a, b) in enumerate(_pairs(11, n_bench))]
    return {
        "s3://rstar2-data/raw/dapo-math-17k.parquet": _parquet(dapo),
        "s3://rstar2-data/raw/openmathreasoning-aops.parquet": _parquet(omr),
        "s3://rstar2-data/raw/project-euler.jsonl": _jsonl(euler),
        "s3://rstar2-data/sft/function-calling.jsonl": _jsonl(fc),
        "s3://rstar2-data/sft/instruction-following.jsonl": _jsonl(ifollow),
        "s3://rstar2-data/sft/chat.parquet": _parquet(chat),
        "s3://rstar2-data/bench/aime24.jsonl": _jsonl(aime),
        "s3://rstar2-data/bench/aime25.jsonl": _jsonl(aime25),
        "s3://rstar2-data/bench/hmmt_feb25.jsonl": _jsonl(hmmt),
        "s3://rstar2-data/bench/math500.jsonl": _jsonl(math500),
        "s3://rstar2-data/bench/gpqa_diamond.parquet": _parquet(gpqa),
    }


def fill(cfg: Any) -> list[str]:
    """Upload the model and every data file to the stores `cfg` names (its S3 endpoint set); returns the
    URLs written. Checks that they are the URLs the profile reads, so that a renamed one fails here."""
    from rstar2_cli.rehearsal_model import BASE_URL, rehearsal_base_model_in_child

    storage.configure_from(cfg.storage)
    files = datasets()
    wanted = {s.url for s in cfg.data.sources} | set(cfg.data.sft_sources) | {b.url for b in cfg.eval.benchmarks}
    if set(files) != wanted:
        raise ValueError(f"the rehearsal's data do not match the profile's URLs: missing {sorted(wanted - set(files))}, "
                         f"extra {sorted(set(files) - wanted)}")
    for url, body in files.items():
        storage.write_bytes_atomic(url, body)
    if cfg.model.name_or_path != BASE_URL:
        raise ValueError(f"the rehearsal uploads its model to {BASE_URL}, the config reads {cfg.model.name_or_path}")
    storage.write_dir_atomic(rehearsal_base_model_in_child(), BASE_URL, meta={"source": "rstar2_cli/rehearsal_model.py"})
    return [*files, BASE_URL]
