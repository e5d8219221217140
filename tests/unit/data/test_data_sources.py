import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar2_core.data.sources import SourceLayoutError, read_source

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def test_dapo_layout_strips_the_instruction_wrapper_and_counts_bad_rows():
    r = read_source(str(FIX / "dapo_math.jsonl"), "dapo")
    assert r.name == "dapo_math" and r.n_rows == 7 and len(r.digest) == 64
    first = r.candidates[0]
    assert first.problem.startswith("A rectangle has a perimeter of 30")
    assert first.problem.endswith("Find the area of the rectangle.")
    assert "Answer:" not in first.problem and "Solve the following" not in first.problem
    assert (first.id, first.answer, first.source) == ("dapo_math/dapo-0000", "54", "math_dapo")
    assert r.rejected == {"missing_field:reward_model": 1}
    assert len(r.candidates) == 6


def test_dapo_parquet_with_nested_columns(tmp_path):
    rows = [json.loads(line) for line in (FIX / "dapo_math.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_model" in r]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    r = read_source(f"file://{path}", "dapo", name="dapo")
    assert [c.answer for c in r.candidates] == [x["reward_model"]["ground_truth"] for x in rows]
    assert r.candidates[2].problem == "Let $x$ satisfy $3x = 6$. Compute the value of $x$."


def test_openmathreasoning_layout_rejects_proofs():
    r = read_source(str(FIX / "openmathreasoning.jsonl"), "openmathreasoning", name="omr")
    assert r.rejected == {"problem_type:converted_proof": 1}
    assert [c.answer for c in r.candidates] == ["\\boxed{12}", "12", "12.5", "$-7$"]
    assert r.candidates[0].source == "aops_c4_high_school_math"


def test_project_euler_layout_and_int_answers():
    r = read_source(str(FIX / "project_euler.jsonl"), "project_euler", name="pe")
    assert [c.id for c in r.candidates] == ["pe/1", "pe/2", "pe/3"]
    assert r.candidates[2].answer == "12" and r.candidates[0].source == "pe"


def test_malformed_rows_are_counted_not_fatal(tmp_path):
    good = {"id": "ok", "problem": "What is 2+2?", "answer": "4"}
    lines = [
        json.dumps(good).encode(),
        b'{"id": "x", "problem": "caf\xe9 ?", "answer": "1"}',          # latin-1 byte: bad encoding
        b'{"id": "y", "problem": ',                                      # truncated JSON
        b'[1, 2, 3]',                                                    # not an object
        json.dumps({"id": "z", "answer": "1"}).encode(),                 # missing problem
        json.dumps({"id": "e", "problem": "   ", "answer": "1"}).encode(),  # empty problem
        json.dumps({"id": "t", "problem": ["list"], "answer": "1"}).encode(),  # wrong type
        json.dumps({"id": "a", "problem": "p?", "answer": {"v": 1}}).encode(),  # wrong answer type
        b'{"id": "s", "problem": "lone \\ud800 surrogate", "answer": "1"}',  # unencodable text
        b'',
        json.dumps({"id": "u", "problem": "mis\ufffddecoded", "answer": "1"}).encode(),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines))
    r = read_source(str(path), "generic")
    assert [c.id for c in r.candidates] == ["mixed/ok"]
    assert r.rejected == {"bad_encoding": 3, "invalid_json": 1, "not_an_object": 1, "missing_field:problem": 1,
                          "empty_problem": 1, "wrong_type:problem": 1, "wrong_type:answer": 1}
    assert r.n_rows == 10


def test_wrong_layout_names_the_expected_fields():
    with pytest.raises(SourceLayoutError) as e:
        read_source(str(FIX / "generic.jsonl"), "dapo")
    msg = str(e.value)
    assert "reward_model.ground_truth" in msg and "prompt" in msg and "found fields" in msg and "'problem'" in msg


def test_unknown_layout_extension_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="valid layouts"):
        read_source(str(FIX / "generic.jsonl"), "nope")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.jsonl .*\.parquet"):
        read_source(str(tmp_path / "x.csv"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_source(str(tmp_path / "absent.jsonl"))
