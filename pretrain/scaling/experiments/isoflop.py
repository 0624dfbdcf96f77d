"""IsoFLOP experiment (Chinchilla's approaches 2 and 3 at CPU scale): GPT, NRGPT, EBT and
Transformer++ at three widths, three compute budgets and two learning rates on the bundled
GPT-2-tokenized corpus, then the fits of `python -m pretrain.scaling fit` over the runs:
IsoFLOP parabolas and the compute-optimal N*(C), D*(C); the joint L(N, D) per family; the
compute-equivalent gain of NRGPT against GPT and of EBT against Transformer++ with intervals.

Training goes through the sweep runner (`parallel_runs` at a time; a rerun skips finished runs
and resumes an interrupted one); the fit outputs go to SWEEP_DIR/fit/.
"""
from __future__ import annotations

from pretrain.scaling import report
from pretrain.scaling.experiments.common import train_sweep
from pretrain.scaling.sweep import load_sweep

SWEEP = "configs/scaling/isoflop.yaml"


def main(overrides: list[str] = ()) -> int:
    sweep = load_sweep(SWEEP, overrides)
    train_sweep(sweep, lambda run: run.flops_budget)
    return report.fit_command(report.FitOptions(dirs=[str(sweep.directory)],
                                                out=str(sweep.directory / "fit")))
