"""Copy probe: can an SFT checkpoint copy numbers? The synthetic task's bottleneck, measured without sampling.

    .venv/bin/python bench/copy_probe.py CHECKPOINT_URL [CHECKPOINT_URL ...] [--n 60] [--json]

For `--n` held-out eval problems it renders the demonstration the SFT data would contain (every tool
response produced by running the code) and scores, teacher-forced, the digit tokens of three spans:
`problem_to_code`, `code_to_code`, `output_to_answer` (mean NLL, greedy accuracy), plus `calls_exact`.
See docs/benchmarks-training.md, "bench/copy_probe.py"; the figures are in docs/sft-learning.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPANS = ("problem_to_code", "code_to_code", "output_to_answer")


def probe(url: str, n: int, seed: int = 0, signposted: bool = False) -> dict:
    import torch

    from rstar2_core.chat import ChatFormat, render_tool_result
    from rstar2_core.config import SandboxConfig
    from rstar2_core.data.synthetic import (
        broken_code,
        demonstration_turns,
        execute_requests,
        generate_problems,
        reference_code,
    )
    from rstar2_core.models.io import load_model_and_tokenizer
    from rstar2_core.sandbox.types import ExecutionRequest

    model, tok = load_model_and_tokenizer(url)
    model.eval()
    chat = ChatFormat(tok)
    rng = random.Random(seed)
    problems = generate_problems(seed, n, "eval")
    codes = [(broken_code(reference_code(p), rng), reference_code(p)) for p in problems]
    reqs = [ExecutionRequest(code=c, id=f"{i}:{j}") for i, cs in enumerate(codes) for j, c in enumerate(cs)]
    results = {r.id: r for r in execute_requests(reqs, SandboxConfig(timeout_s=10.0))}  # as the SFT data runs them
    sums = {s: [0.0, 0, 0] for s in SPANS}
    exact = 0
    for i, (p, cs) in enumerate(zip(problems, codes)):
        turns = [(t, list(r) if r is not None else None)   # exactly what the SFT data would hold
                 for t, r in demonstration_turns(p, cs, [results[f"{i}:0"], results[f"{i}:1"]], render_tool_result,
                                                 signposted)]
        ids, mask = chat.render_trajectory(p.problem, turns)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        turn, prev, first_ok = -1, 0, True
        for j in range(1, len(ids)):
            if mask[j] and not prev:
                turn += 1
            prev = mask[j]
            if not mask[j] or not tok.decode([ids[j]]).strip().isdigit():
                continue
            hit = int(logp[j - 1].argmax()) == ids[j]
            s = sums[SPANS[turn]]
            s[0] += -float(logp[j - 1, ids[j]])
            s[1] += 1
            s[2] += hit
            if turn == 0:
                first_ok &= hit
        exact += first_ok
    out = {s: {"nll": round(v[0] / max(v[1], 1), 3), "acc": round(v[2] / max(v[1], 1), 3), "digits": v[1]}
           for s, v in sums.items()}
    out["calls_exact"] = round(exact / max(len(problems), 1), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--n", type=int, default=60, help="held-out eval problems")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--signposted", action="store_true",
                    help="open the failing first call with its own reason line, as data.synthetic.fail_first_signposted "
                         "demonstrations do")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    res = {}
    for url in args.checkpoints:
        res[url] = r = probe(url, args.n, signposted=args.signposted)
        print(f"{url}: " + " | ".join(f"{s} NLL {r[s]['nll']:.2f} acc {r[s]['acc']:.2f}" for s in SPANS)
              + f" | first call all digits right {r['calls_exact']:.2f}", flush=True)
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
