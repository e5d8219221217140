"""The rehearsal's stand-in for Qwen3-14B-Base: SmolLM2-135M-Instruct that writes the recipe's answer
format, made by the project's own SFT.

    path = rehearsal_base_model()          # an HF folder with `_COMPLETE`

Untuned SmolLM2 never boxes an answer (the label check kept 0 of 8 problems, RL saw only all-wrong
groups), so this runs a short `run_sft` (local runtime) on demonstrations in the recipe's format, a third
calling the tool, two thirds answering directly with the boxed answer out of the loss (`mask_answer`).
Invariant: the model must solve some problems and miss others (the label check, RoC and the hard subset
need both). Cached per machine under `$RSTAR2_HOME/cache/models/` by a digest of the data and settings.
See docs/rehearsal.md, "Rehearsing the production profile".
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

from rstar2_core import storage

BASE_URL = "s3://rstar2-models/SmolLM2-135M-Instruct-recipe-format"
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of "
             "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
"""DAPO's instruction around each problem (rehearsal_data.py's DAPO parquet and the demonstrations here)."""
SFT_OVERRIDES = ("data.synthetic.enabled=false", "sft.epochs=1", "sft.batch_size=4", "sft.micro_batch_size=4",
                 "sft.lr=5e-5", "sft.schedule=\"constant\"", "sft.warmup_ratio=0.0", "sft.max_seq_len=1024",
                 "sft.checkpoint_every=0", "sft.backend=\"torch\"")
"""Overrides of the `smol` profile for this SFT: one pass of small constant-lr steps (tool demonstrations
alone: loss 0.85, 0.41, 0.22, 0.10, 0.03, 0.007 over the first six steps when measured). A final loss
above 0.25 means the format was not learned: refused."""
N_ROWS = 120


def format_rows(n: int = N_ROWS, seed: int = 12) -> list[dict]:
    """Recipe SFT rows ({"problem", "turns"}) of the three RL sources' wordings with two-digit numbers:
    every third row calls the tool and boxes its output, the others answer directly (`mask_answer`)."""
    from rstar2_core.chat import render_tool_result
    from rstar2_core.chat.tokens import REASON_CLOSE
    from rstar2_core.data.synthetic import DIRECT_REASON, answer_text, demonstration_turns
    from rstar2_core.sandbox.types import ExecutionResult, Status

    rng = random.Random(seed)
    forms = (lambda a, b: (f"{DAPO_HEAD}What is {a} plus {b}?{DAPO_TAIL}", f"{a} + {b}", a + b),
             lambda a, b: (f"Compute {a} times {b}.", f"{a} * {b}", a * b),
             lambda a, b: (f"Find {a + b} minus {b}.", f"{a + b} - {b}", a))
    rows = []
    for i in range(n):
        problem, expr, value = forms[i % len(forms)](rng.randint(10, 60), rng.randint(10, 60))
        row = {"id": f"format-{i:04d}", "problem": problem, "answer": str(value)}
        if i % 3 == 0:
            out = ExecutionResult(id=f"c{i}", status=Status.OK, stdout=f"{value}\n", stderr="", exit_code=0,
                                  duration_s=0.01)
            turns = demonstration_turns(SimpleNamespace(answer=str(value)), [f"print({expr})"], [out],
                                        render_tool_result)
        else:
            turns = ((f"\n{DIRECT_REASON}\n{REASON_CLOSE}\n{answer_text(str(value))}", None),)
            row["mask_answer"] = True
        row["turns"] = [[t, list(r) if r is not None else None] for t, r in turns]
        rows.append(row)
    return rows


def rehearsal_base_model() -> Path:
    """The model's HF folder: trained on first use, then read from the cache (`_COMPLETE` written last)."""
    from rstar2_core.config import load_config
    from rstar2_core.models.smollm2 import cache_dir, convert_smollm2
    from rstar2_core.sft.data import build_sft_dataset
    from rstar2_core.sft.train import run_sft

    base = convert_smollm2()
    rows = format_rows()
    key = hashlib.sha256(json.dumps([rows, SFT_OVERRIDES, base.name]).encode()).hexdigest()[:12]
    dst = cache_dir().parent / f"rehearsal-base-{key}"
    if storage.is_complete(str(dst)):
        return dst
    with tempfile.TemporaryDirectory(prefix="rstar2-rehearsal-base-") as tmp:
        src = Path(tmp) / "format-sft.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = load_config("smol", [*SFT_OVERRIDES, f"data.sft_sources=[\"{src}\"]"])
        ref = build_sft_dataset(cfg, str(Path(tmp) / "sft.jsonl"))
        res = run_sft(cfg, base_model_url=str(base), sft_data_url=ref.url, out_url=str(Path(tmp) / "out"),
                      resume=False)
        if res.metrics["sft/loss"] > 0.25:
            raise RuntimeError(f"the rehearsal's base model did not learn the answer format (final SFT loss "
                               f"{res.metrics['sft/loss']:.3f} > 0.25); see rstar2_cli/rehearsal_model.py")
        storage.write_dir_atomic(Path(res.checkpoint_url), str(dst), meta={"sft_loss": res.metrics["sft/loss"]})
    return dst


def rehearsal_base_model_in_child() -> Path:
    """`rehearsal_base_model()` in a child process, so that the caller (the rehearsal's driver, up for the
    whole run) does not keep the training's memory (~4 GB on CPU: torch's allocator keeps it)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rstar2_cli.rehearsal_model"], check=True, stdout=subprocess.PIPE,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(rehearsal_base_model())
