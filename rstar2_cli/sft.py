"""`rstar2 sft data|train`: build the SFT conversations, or run (resume) non-reasoning SFT (thin
wrappers over `rstar2_core.sft.data.build_sft_dataset` and `rstar2_core.sft.train.run_sft`).

    rstar2 sft data  --profile tiny --out file:///.../sft.jsonl
    rstar2 sft train --profile tiny --base file:///.../base --data file:///.../sft.jsonl --out file:///.../sft

A rerun of `train` resumes from the last complete step checkpoint unless `--no-resume`. Metrics go to
stdout as one JSON line per step (the progress bar to stderr).
"""

from __future__ import annotations

import argparse
import json

from rstar2_cli.common import add_profile_args, fail, input_problem, load, step_logger


def _data(args: argparse.Namespace) -> int:
    cfg = load(args)
    if problem := input_problem(outputs={"--out": args.out}):
        return fail("sft data", problem)
    from rstar2_core.sft.data import build_sft_dataset

    print(json.dumps(build_sft_dataset(cfg, args.out).to_json()))
    return 0


def _train(args: argparse.Namespace) -> int:
    cfg = load(args)
    if problem := input_problem(checkpoints={"--base": args.base}, files={"--data": args.data},
                                outputs={"--out": args.out}):
        return fail("sft train", problem)
    from rstar2_core.sft.train import run_sft

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        res = run_sft(cfg, base_model_url=args.base, sft_data_url=args.data, out_url=args.out,
                      log_metrics=step_logger(), resume=not args.no_resume)
    except ValueError as e:  # a bad row of --data (read_sft_rows names the file and line)
        return fail("sft train", str(e))
    print(json.dumps({"result": res.to_json()}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="non-reasoning SFT: data and training")
    ssub = p.add_subparsers(dest="sft_command", required=True)
    data = ssub.add_parser("data", help="write the SFT conversations (JSONL) and their manifest")
    add_profile_args(data)
    data.add_argument("--out", required=True, help="URL of the JSONL to write (manifest at <out>.manifest.json)")
    data.set_defaults(func=_data)
    train = ssub.add_parser("train", help="run (or resume) SFT")
    add_profile_args(train)
    train.add_argument("--base", required=True, help="base checkpoint URL (rstar2 model prepare)")
    train.add_argument("--data", required=True, help="SFT JSONL URL (rstar2 sft data)")
    train.add_argument("--out", required=True, help="output folder URL (steps/ and final/ checkpoints)")
    train.add_argument("--no-resume", action="store_true", help="start over even if step checkpoints exist")
    train.add_argument("--threads", type=int, default=0,
                       help="torch intra-op threads (0 = torch's default; 1 is faster on busy shared cores)")
    train.set_defaults(func=_train)
