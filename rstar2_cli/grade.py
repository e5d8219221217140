"""`rstar2 grade [--workers N] [--timeout-s T] < in.jsonl > out.jsonl`: grade responses against gold answers.

Input lines `{"id": ..., "response": "...", "gold": "..."}` (a numeric gold is accepted); output lines
`{"id": ..., "reward": 0 or 1, "extracted": "..." or null, "reason": "..."}`, exactly one per input
line, in order. A line that is not a JSON object with those fields gives reward 0 and reason
`invalid_request` (id null when unknown) and the stream goes on. Output is streamed: lines are graded
in batches as they arrive (a batch is whatever is available within ~20 ms, at most `--batch` lines),
so a producer can wait for each answer. Grading runs in `GraderPool` worker processes with a hard
per-item timeout (`grader_timeout`). A summary and a progress bar go to stderr. Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from collections import Counter

from rstar2_cli.common import add_profile_args, load

_EOF = object()


def parse_line(line: str) -> tuple[object, tuple[str, str] | None, str | None]:
    """(id, (response, gold) or None, why the line is invalid or None)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, None, f"not valid JSON ({e.msg})"
    if not isinstance(obj, dict):
        return None, None, "not a JSON object"
    rid = obj.get("id")
    missing = [k for k in ("id", "response", "gold") if k not in obj]
    if missing:
        return rid, None, f"missing field(s) {missing}"
    response, gold = obj["response"], obj["gold"]
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)
    if not isinstance(response, str) or not isinstance(gold, str):
        return rid, None, '"response" and "gold" must be strings'
    return rid, (response, gold), None


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(_EOF)


def _next_batch(q: queue.Queue, max_lines: int) -> tuple[list[str], bool]:
    """Block for one line, then take what arrives within ~20 ms (up to max_lines). Returns (lines, at_eof)."""
    first = q.get()
    if first is _EOF:
        return [], True
    lines = [first]
    while len(lines) < max_lines:
        try:
            item = q.get(timeout=0.02)
        except queue.Empty:
            break
        if item is _EOF:
            return lines, True
        lines.append(item)
    return lines, False


def _grade(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rstar2_core.reward import GraderPool

    timeout_s = args.timeout_s if args.timeout_s is not None else load(args).eval.grader_timeout_s
    q: queue.Queue = queue.Queue(maxsize=4 * args.batch)
    threading.Thread(target=_reader, args=(sys.stdin, q), daemon=True).start()
    reasons: Counter[str] = Counter()
    n_line = 0
    bar = tqdm(file=sys.stderr, unit="line", desc="grade", mininterval=1.0, disable=args.quiet)
    with GraderPool(workers=args.workers, timeout_s=timeout_s) as pool:
        at_eof = False
        while not at_eof:
            lines, at_eof = _next_batch(q, args.batch)
            parsed = [parse_line(line) for line in lines]
            valid = [p[1] for p in parsed if p[1] is not None]
            graded = iter(pool.grade_many(valid)) if valid else iter(())
            out = []
            for rid, item, why in parsed:
                n_line += 1
                if item is None:
                    print(f"rstar2 grade: line {n_line}: {why}: reason invalid_request", file=sys.stderr)
                    row = {"id": rid, "reward": 0, "extracted": None, "reason": "invalid_request"}
                else:
                    row = {"id": rid, **next(graded).to_json()}
                reasons[row["reason"]] += 1
                out.append(json.dumps(row, ensure_ascii=False))
            if out:
                sys.stdout.write("\n".join(out) + "\n")
                sys.stdout.flush()
            bar.update(len(lines))
    bar.close()
    summary = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "no input"
    print(f"rstar2 grade: {n_line} lines: {summary}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grade", help="grade JSONL responses against gold answers (stdin -> stdout)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=0, help="grader processes; 0 = one per CPU core (default)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="hard per-item timeout in seconds (default: eval.grader_timeout_s of the profile, 5)")
    p.add_argument("--batch", type=int, default=256, help="most lines graded together (default 256)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    add_profile_args(p)
    p.set_defaults(func=_grade)
