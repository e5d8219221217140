"""Does the tiny SFT cross the copying phase change, seed after seed? The same SFT set, several model seeds.

    .venv/bin/python bench/sft_seeds.py [--seeds 0 1 2] [--set sft.lr=5e-3 ...] [--json]
        [--stop-after 50] [--cap 1200] [--sft-data file:///.../sft-data] [--parallel 2 --threads 1]

Builds the profile's SFT set once, then per seed runs `run_sft` (the code the pipeline runs) and scores
the result with the copy probe. A schedule is judged by how many seeds cross and how early.
See docs/benchmarks-training.md, "bench/sft_seeds.py" (screening, keys), and docs/sft-learning.md,
"Model seeds".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

WINDOW = 50   # steps in the running mean that decides the crossing


def crossing(losses: list[float], threshold: float) -> int | None:
    """First step (1-based) whose WINDOW-step mean loss is below `threshold`, None if none is."""
    total = 0.0
    for i, x in enumerate(losses):
        total += x - (losses[i - WINDOW] if i >= WINDOW else 0.0)
        if i >= WINDOW - 1 and total / WINDOW < threshold:
            return i + 1
    return None


def should_stop(losses: list[float], threshold: float, stop_after: int | None, cap: int | None) -> bool:
    """Screening rule: stop `stop_after` steps after the crossing, or at step `cap` (either None: never)."""
    if cap is not None and len(losses) >= cap:
        return True
    if stop_after is None:
        return False
    c = crossing(losses, threshold)
    return c is not None and len(losses) >= c + stop_after


class _Stopped(Exception):
    """Raised from the metrics callback to end a screening run."""


def plot(curves: dict[int, list[float]], threshold: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for seed, losses in sorted(curves.items()):
        means = [sum(losses[max(0, i - WINDOW + 1):i + 1]) / len(losses[max(0, i - WINDOW + 1):i + 1])
                 for i in range(len(losses))]
        ax.plot(range(1, len(means) + 1), means, label=f"seed {seed}")
    ax.axhline(threshold, color="gray", ls="--", lw=1, label=f"crossed below {threshold}")
    ax.set(yscale="log", xlabel="SFT step", ylabel=f"loss ({WINDOW}-step mean)", title=title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _one_seed(seed, cfg, data_url, base_url, out_url, stop_after, cap, probe_n, threads):
    """One model seed: prepare the base model, run SFT (the pipeline's `run_sft`), probe it. Runs in the
    bench's process or in a worker of `--parallel` (spawned: its own torch threads)."""
    import torch

    torch.set_num_threads(threads)
    from copy_probe import probe
    from learning import SFT_CROSSED_LOSS, late_loss

    from rstar2_core.errors import SFTNotConverged
    from rstar2_core.models import prepare_base_model
    from rstar2_core.sft.train import run_sft

    t0 = time.time()
    base = prepare_base_model(cfg, base_url)
    losses: list[float] = []

    def record(m, step):
        losses.append(float(m["sft/loss"]))
        if should_stop(losses, SFT_CROSSED_LOSS, stop_after, cap):
            raise _Stopped

    try:
        res = run_sft(cfg, base_model_url=base, sft_data_url=data_url, out_url=out_url, log_metrics=record,
                      resume=False)
    except (_Stopped, SFTNotConverged):   # a screening stop, or the profile's own cap without converging
        res = None
    run = {"seed": seed, "steps": len(losses), "stopped": res is None,
           "cross_step": crossing(losses, SFT_CROSSED_LOSS), "late_loss": late_loss(losses),
           "sft_s": round(time.time() - t0, 1), "probe": None if res is None else probe(res.checkpoint_url, probe_n)}
    return run, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="model seeds, one full SFT each")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--probe-n", type=int, default=60, help="held-out problems of the copy probe")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the demo's SFT uses 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="screening: stop a run this many steps after its crossing (no final checkpoint, no probe)")
    ap.add_argument("--cap", type=int, default=None, help="screening: stop a run at this step")
    ap.add_argument("--parallel", type=int, default=1,
                    help="seeds run at once, each in its own process with --threads threads (e.g. 2 x 1 on 2 cores)")
    ap.add_argument("--sft-data", default=None, help="URL of an SFT set built by an earlier run (default: build one)")
    args = ap.parse_args(argv)
    if (args.stop_after is not None and args.stop_after < 0) or (args.cap is not None and args.cap < 1):
        ap.error("--stop-after must be >= 0 and --cap >= 1")

    os.environ.setdefault("RSTAR2_HOME", str(ROOT / ".rstar2"))
    import torch

    torch.set_num_threads(args.threads)
    from learning import SFT_CROSSED_LOSS

    from rstar2_core import storage
    from rstar2_core.config import load_config
    from rstar2_core.sft.data import build_sft_dataset

    t_start, load_before = time.time(), os.getloadavg()
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    work = (Path(os.environ["RSTAR2_HOME"]) / "bench" / f"sft-seeds-{stamp}").resolve()
    root = work.as_uri()

    def log(msg: str) -> None:
        print(f"[sft seeds {time.time() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    cfgs = {seed: load_config(args.profile, [*args.overrides, f"seed={seed}"]) for seed in args.seeds}
    if args.sft_data:
        data_url = args.sft_data
        log(f"SFT set: {data_url} (reused); {len(args.seeds)} runs, overrides {args.overrides}")
    else:
        data = build_sft_dataset(next(iter(cfgs.values())), storage.join(root, "sft-data"))  # the seed is not in it
        data_url = data.url
        log(f"SFT set: {data.n_rows} conversations; {len(args.seeds)} runs, overrides {args.overrides}")
    jobs = [(seed, cfg, data_url, storage.join(root, f"base-seed{seed}"), storage.join(root, f"sft-seed{seed}"),
             args.stop_after, args.cap, args.probe_n, args.threads) for seed, cfg in cfgs.items()]
    runs, curves = [], {}

    def collect(run: dict, losses: list[float]) -> None:
        runs.append(run)
        curves[run["seed"]] = losses
        done = time.time() - t_start
        log(f"seed {run['seed']}: crossed at step {run['cross_step']} of {run['steps']}, late loss "
            f"{run['late_loss']}, copy probe exact {run['probe']['calls_exact'] if run['probe'] else '-'} "
            f"({run['sft_s']:.0f} s) [{len(runs)}/{len(jobs)}, ETA {done / len(runs) * (len(jobs) - len(runs)):.0f} s]")

    if args.parallel > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(args.parallel, mp_context=mp.get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(_one_seed, *job) for job in jobs]):
                collect(*fut.result())
        runs.sort(key=lambda r: r["seed"])
    else:
        for job in jobs:
            collect(*_one_seed(*job))
    png = Path(os.environ["RSTAR2_HOME"]).resolve() / "bench" / f"sft-seeds-{stamp}.png"
    plot(curves, SFT_CROSSED_LOSS, png, f"tiny SFT, {' '.join(args.overrides) or 'profile as committed'}")
    out = {"runs": runs, "crossed": sum(r["cross_step"] is not None for r in runs), "of": len(runs),
           "overrides": args.overrides, "plot": str(png), "wall_s": round(time.time() - t_start, 1),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    print(f"crossed in {out['crossed']} of {out['of']} runs: "
          + ", ".join(f"seed {r['seed']} -> {r['cross_step']}" for r in runs) + f"; plot {png}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
