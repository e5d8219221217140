"""Which aliases a recipe run's best checkpoint earns: `candidate` when it beats the run's own SFT
checkpoint, `champion` when it also beats the current champion, both by a paired bootstrap interval
that lies above 0 on the primary benchmark (eval/compare.py, `eval.comparison_confidence`).

    p = decide_promotion("rl-stage-1", best, sft_report, champion=("version 3", champ_report),
                         benchmark="synthetic", confidence=0.95, seed=1234)
    p.aliases   # ("candidate", "champion"), ("candidate",) or ()
    p.line()    # rl-stage-1 0.52 vs sft 0.31, +0.21 [0.14, 0.28] -> candidate, champion

Invariant: no comparison means no evidence: a champion that cannot be compared (unreadable report, no
shared problem, `incomparable`) is kept; `champion=None` means none yet. See docs/pipeline.md, "Promotion".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rstar2_core.eval.compare import Comparison, compare_benchmark
from rstar2_core.eval.metrics import EvalReport

SFT_STAGE = "sft"


@dataclass(frozen=True)
class Promotion:
    """The decision for `stage` on `benchmark`, with the comparisons it rests on."""

    stage: str
    benchmark: str
    pass1: float
    aliases: tuple[str, ...]
    reason: str
    vs_sft: Comparison | None = None
    vs_champion: Comparison | None = None
    champion_label: str | None = None

    def line(self) -> str:
        """`rl-stage-1 0.52 vs sft 0.31, +0.21 [0.14, 0.28]; vs champion (version 3) 0.50, +0.02 [-0.03, 0.07]
        -> candidate (ties the champion)`."""
        parts = [f"{self.stage} {self.pass1:.2f}"]
        if self.vs_sft is not None:
            parts[0] += f" vs {SFT_STAGE} {self.vs_sft.baseline:.2f}, {self.vs_sft.interval_text()}"
        if self.vs_champion is not None:
            base = "-" if self.vs_champion.baseline is None else f"{self.vs_champion.baseline:.2f}"
            parts.append(f"vs champion ({self.champion_label}) {base}, {self.vs_champion.interval_text()}")
        decision = ", ".join(self.aliases) if self.aliases else "no alias"
        return "; ".join(parts) + f" -> {decision}" + (f" ({self.reason})" if self.reason else "")

    def to_json(self) -> dict:
        return {"stage": self.stage, "benchmark": self.benchmark, "pass1": self.pass1,
                "aliases": list(self.aliases), "reason": self.reason, "line": self.line(),
                "champion_label": self.champion_label,
                "vs_sft": _plain(self.vs_sft), "vs_champion": _plain(self.vs_champion)}


def _plain(c: Comparison | None) -> dict | None:
    """A comparison as JSON reads it back (lists, not tuples): a stored decision equals a fresh one."""
    return None if c is None else {**asdict(c), "differs": list(c.differs)}


def decide_promotion(stage: str, report: EvalReport, sft_report: EvalReport, *,
                     champion: tuple[str, EvalReport | None] | None, benchmark: str, confidence: float,
                     seed: int) -> Promotion:
    """Aliases for the best-ranked `stage` (its `report`) of a run whose SFT checkpoint scored `sft_report`.
    `champion`: (label, its report or None when it cannot be found), or None when there is no champion."""
    pass1 = report.metrics[benchmark].pass1 if benchmark in report.metrics else float("nan")
    if stage == SFT_STAGE:
        return Promotion(stage, benchmark, pass1, (), "the SFT checkpoint ranked best: RL did not help")
    vs_sft = compare_benchmark(report, sft_report, benchmark, confidence=confidence, seed=seed)
    if vs_sft.verdict != "better":
        why = {"worse": "RL made it worse than SFT", "tie": "RL did not beat SFT beyond noise",
               "new": f"the SFT evaluation has no {benchmark!r}", "unpaired": "no problem in common with SFT",
               "incomparable": "not comparable with the SFT evaluation: " + "; ".join(vs_sft.differs)}
        return Promotion(stage, benchmark, pass1, (), why[vs_sft.verdict], vs_sft=vs_sft)
    if champion is None:
        return Promotion(stage, benchmark, pass1, ("candidate", "champion"), "no champion yet", vs_sft=vs_sft)
    label, champ_report = champion
    if champ_report is None:
        return Promotion(stage, benchmark, pass1, ("candidate",),
                         f"champion ({label}) kept: its evaluation report cannot be found", vs_sft=vs_sft,
                         champion_label=label)
    vs_champ = compare_benchmark(report, champ_report, benchmark, confidence=confidence, seed=seed)
    if vs_champ.verdict == "better":
        return Promotion(stage, benchmark, pass1, ("candidate", "champion"), "", vs_sft=vs_sft,
                         vs_champion=vs_champ, champion_label=label)
    why = {"worse": "worse than the champion", "tie": "ties the champion",
           "new": f"the champion was not evaluated on {benchmark!r}", "unpaired": "no problem in common with "
           "the champion's evaluation",
           "incomparable": f"champion ({label}) kept: its evaluation is not comparable with this one ("
           + "; ".join(vs_champ.differs) + ")"}
    return Promotion(stage, benchmark, pass1, ("candidate",), why[vs_champ.verdict], vs_sft=vs_sft,
                     vs_champion=vs_champ, champion_label=label)
