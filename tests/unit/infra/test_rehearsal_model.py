"""The rehearsal's base model learns the recipe's answer format from demonstrations of the three RL
sources' wordings: every row is a valid recipe SFT row; the tool rows' call parses and, run, prints the
answer they then box; the direct rows keep their answer out of the loss; the numbers are not the uploaded
problems' (no label is taught)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from rstar2_cli.rehearsal_data import datasets
from rstar2_cli.rehearsal_model import BASE_URL, format_rows


def test_format_rows_are_valid_demonstrations():
    from rstar2_core.chat import extract_answer, parse_tool_calls
    from rstar2_core.sft.data import validate_row

    rows = format_rows()
    assert len(rows) == len({r["problem"] for r in rows}) >= 60
    tool = rows[0::3]
    direct = [r for i, r in enumerate(rows) if i % 3]
    assert 2 * len(tool) >= len(direct) >= len(tool) and all(r["mask_answer"] for r in direct)
    for r in rows[:12]:
        assert validate_row(r) is None, validate_row(r)
        assert extract_answer(r["turns"][-1][0]) == r["answer"] and r["turns"][-1][1] is None
    for r in tool[:6]:
        (call_text, results), _ = r["turns"]
        calls = parse_tool_calls(call_text)
        assert len(calls) == 1 and len(results) == 1, call_text
        out = subprocess.run([sys.executable, "-c", calls[0].code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == r["answer"] and results[0].startswith(r["answer"] + "\n")
    assert all(len(r["turns"]) == 1 and "without the tool" in r["turns"][0][0] for r in direct)


def test_the_direct_answers_are_kept_out_of_the_sft_loss(tmp_path):
    """The rows go through `data.sft_sources` (as the rehearsal's SFT reads them): `mask_answer` survives."""
    from rstar2_core.config import load_config
    from rstar2_core.sft.data import build_sft_dataset, read_sft_rows

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in format_rows(6)))
    cfg = load_config("smol", ["data.synthetic.enabled=false", f'data.sft_sources=["{src}"]'])
    rows = read_sft_rows(build_sft_dataset(cfg, str(tmp_path / "sft.jsonl")).url)
    assert [r["mask_answer"] for r in rows] == [False, True, True] * 2


def test_the_taught_problems_are_not_the_uploaded_ones():
    import pyarrow.parquet as pq

    files = datasets()
    uploaded = {json.loads(line)["problem"] for line in files["s3://rstar2-data/raw/project-euler.jsonl"].splitlines()}
    uploaded |= set(pq.read_table(io.BytesIO(files["s3://rstar2-data/raw/openmathreasoning-aops.parquet"]))
                    .column("problem").to_pylist())
    taught = {r["problem"] for r in format_rows()}
    assert taught and not taught & uploaded
    assert BASE_URL.startswith("s3://rstar2-models/")
