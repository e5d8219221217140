"""`rstar2 model prepare|info`: build/convert the base model (thin wrapper over
`rstar2_core.models.prepare_base_model`), or describe a checkpoint.

    rstar2 model prepare --profile tiny --out file:///.../base        # tokenizer + fresh tiny Qwen2
    rstar2 model prepare --profile smol --out file:///.../base        # SmolLM2 GGUF -> HF (cached)
    rstar2 model info --checkpoint file:///.../sft/final
"""

from __future__ import annotations

import argparse
import json

from rstar2_cli.common import add_profile_args, fail, input_problem, load


def _prepare(args: argparse.Namespace) -> int:
    cfg = load(args)
    if problem := input_problem(outputs={"--out": args.out}):
        return fail("model prepare", problem)
    from rstar2_core.models import prepare_base_model

    print(json.dumps({"checkpoint_url": prepare_base_model(cfg, args.out)}))
    return 0


def _info(args: argparse.Namespace) -> int:
    if problem := input_problem(checkpoints={"--checkpoint": args.checkpoint}):
        return fail("model info", problem)
    from rstar2_core.models import load_model_and_tokenizer, read_meta

    model, tok = load_model_and_tokenizer(args.checkpoint)
    print(json.dumps({"checkpoint_url": args.checkpoint, "architecture": type(model).__name__,
                      "n_params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tok),
                      "dtype": str(next(model.parameters()).dtype), "meta": read_meta(args.checkpoint)},
                     default=str))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="base model preparation and checkpoint info")
    msub = p.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help="build (tiny), convert (smollm2) or publish (hf) the base model")
    add_profile_args(prep)
    prep.add_argument("--out", required=True, help="checkpoint URL to publish (reused if already complete)")
    prep.set_defaults(func=_prepare)
    info = msub.add_parser("info", help="architecture, size and metadata of a checkpoint")
    info.add_argument("--checkpoint", required=True, help="complete checkpoint URL")
    info.set_defaults(func=_info)
