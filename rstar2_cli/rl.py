"""`rstar2 rl run|hard-subset`: one RL stage, or the hard subset between stages (thin wrappers over
`rstar2_core.rl.stage.run_rl_stage` and `rstar2_core.rl.hard_subset.select_hard_subset`).

    rstar2 rl run --profile tiny --stage 1 --init file:///.../sft/final --data file:///.../problems.parquet \
        --out file:///.../rl-stage-1
    rstar2 rl hard-subset --profile tiny --stage 3 --checkpoint file:///.../rl-stage-2/final \
        --data file:///.../problems.parquet --out file:///.../hard-subset

`--stage` is 1-based, as in the stage names (`rl-stage-1`). A rerun resumes from the stage's last
checkpoint unless `--no-resume`. Metrics go to stdout as one JSON line per step.
"""

from __future__ import annotations

import argparse
import json

from rstar2_cli.common import add_profile_args, fail, input_problem, load, step_logger


def _stage_index(cfg, stage: int) -> int:
    if not 1 <= stage <= len(cfg.rl.stages):
        raise SystemExit(f"rstar2 rl: --stage {stage} is out of range; the profile has stages 1..{len(cfg.rl.stages)}")
    return stage - 1


def _run(args: argparse.Namespace) -> int:
    cfg = load(args)
    stage_index = _stage_index(cfg, args.stage)
    if problem := input_problem(checkpoints={"--init": args.init}, files={"--data": args.data},
                                outputs={"--out": args.out}):
        return fail("rl run", problem)
    from rstar2_core.rl.stage import run_rl_stage

    try:
        res = run_rl_stage(cfg, stage_index, init_checkpoint_url=args.init, data_url=args.data,
                           out_url=args.out, log_metrics=step_logger(), resume=not args.no_resume,
                           tracking_run_id=args.run_id)
    except ValueError as e:  # --data has no usable problem (load_problems names the file and the rejections)
        return fail("rl run", str(e))
    print(json.dumps({"result": res.to_json()}))
    return 0


def _hard_subset(args: argparse.Namespace) -> int:
    cfg = load(args)
    stage_index = _stage_index(cfg, args.stage)
    if problem := input_problem(checkpoints={"--checkpoint": args.checkpoint}, files={"--data": args.data},
                                outputs={"--out": args.out}):
        return fail("rl hard-subset", problem)
    from rstar2_core.rl.hard_subset import select_hard_subset

    try:
        ref = select_hard_subset(cfg, stage_index, checkpoint_url=args.checkpoint, data_url=args.data,
                                 out_url=args.out)
    except ValueError as e:  # no usable problem in --data, or an empty subset (the message names the fix)
        return fail("rl hard-subset", str(e))
    print(json.dumps(ref.to_json()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rl", help="GRPO-RoC RL stages")
    rsub = p.add_subparsers(dest="rl_command", required=True)
    run = rsub.add_parser("run", help="run (or resume) one RL stage")
    add_profile_args(run)
    run.add_argument("--stage", type=int, required=True, help="stage number, 1-based (rl-stage-N)")
    run.add_argument("--init", required=True, help="checkpoint URL to start from (SFT or the previous stage's final)")
    run.add_argument("--data", required=True, help="URL of the problems (parquet or JSONL: id, problem, answer)")
    run.add_argument("--out", required=True, help="output folder URL (steps/ and final/ checkpoints)")
    run.add_argument("--run-id", default=None, help="tracking run id stored in the checkpoints")
    run.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints under --out")
    run.set_defaults(func=_run)
    hs = rsub.add_parser("hard-subset", help="drop problems the policy solves k/k (before a hard_subset stage)")
    add_profile_args(hs)
    hs.add_argument("--stage", type=int, required=True, help="the stage that will train on the subset, 1-based")
    hs.add_argument("--checkpoint", required=True, help="policy checkpoint URL (the previous stage's final)")
    hs.add_argument("--data", required=True, help="URL of the problems to filter")
    hs.add_argument("--out", required=True, help="output folder URL (problems.parquet + manifest.json)")
    hs.set_defaults(func=_hard_subset)
