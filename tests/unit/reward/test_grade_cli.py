"""`rstar2 grade` as a subprocess: one output line per input line, in order, streamed, exit 0."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from rstar2_cli.grade import parse_line

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("line, rid, item, why", [
    ('{"id": 1, "response": "r", "gold": "5"}', 1, ("r", "5"), None),
    ('{"id": "a", "response": "r", "gold": 5}', "a", ("r", "5"), None),
    ("not json", None, None, "not valid JSON"),
    ("[1, 2]", None, None, "not a JSON object"),
    ('{"id": 7, "response": "r"}', 7, None, "missing field(s) ['gold']"),
    ('{"response": "r", "gold": "1"}', None, None, "missing field(s) ['id']"),
    ('{"id": 8, "response": ["r"], "gold": "1"}', 8, None, "must be strings"),
    ('{"id": 9, "response": "r", "gold": true}', 9, None, "must be strings"),
])
def test_parse_line(line, rid, item, why):
    got_id, got_item, got_why = parse_line(line)
    assert (got_id, got_item) == (rid, item)
    assert (got_why is None) if why is None else (why in got_why)


def _readline(proc: subprocess.Popen, timeout: float = 90.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "rstar2 grade produced no output line in time (not streaming?)"
    return proc.stdout.readline()


@pytest.mark.slow
def test_grade_cli_streams_and_keeps_order():
    proc = subprocess.Popen([sys.executable, "-m", "rstar2_cli.main", "grade", "--workers", "1", "--timeout-s", "2",
                             "--quiet"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # streaming: the first answer comes back while stdin is still open
        proc.stdin.write(json.dumps({"id": "s", "response": r"<answer>\boxed{1,000}</answer>", "gold": "1000"}) + "\n")
        proc.stdin.flush()
        first = json.loads(_readline(proc))
        assert first == {"id": "s", "reward": 1, "extracted": "1,000", "reason": "correct"}
        rest = [
            json.dumps({"id": 1, "response": r"<answer>\boxed{\frac{1}{2}}</answer>", "gold": "0.5"}),
            "{not json",
            json.dumps({"id": 2, "response": "no box"}),
            json.dumps({"id": 3, "response": r"\boxed{7}", "gold": 8}),
            "",
            json.dumps({"id": 4, "response": r"<answer>\boxed{(10^{8})!}</answer>", "gold": "5"}),
            json.dumps({"id": 5, "response": "no box", "gold": "1"}),
            json.dumps({"id": 6, "response": r"\boxed{x^2+1}", "gold": "1+x^2"}),
        ]
        out, err = proc.communicate("\n".join(rest) + "\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [
        {"id": 1, "reward": 1, "extracted": r"\frac{1}{2}", "reason": "correct"},
        {"id": None, "reward": 0, "extracted": None, "reason": "invalid_request"},
        {"id": 2, "reward": 0, "extracted": None, "reason": "invalid_request"},
        {"id": 3, "reward": 0, "extracted": "7", "reason": "wrong"},
        {"id": None, "reward": 0, "extracted": None, "reason": "invalid_request"},
        {"id": 4, "reward": 0, "extracted": "(10^{8})!", "reason": "grader_timeout"},
        {"id": 5, "reward": 0, "extracted": None, "reason": "no_answer"},
        {"id": 6, "reward": 1, "extracted": "x^2+1", "reason": "correct"},
    ]
    assert "line 3: not valid JSON" in err and "9 lines" in err
