"""Character-level Shakespeare with the NRGPT authors' dropout: GPT and NRGPT at dropout 0.1
(NRGPT with the authors' placement, on the attention probabilities and the summed attention
term at every step), looking for the paper's effect: GPT's val loss turning upward while
NRGPT's train/val gap stays small.

The same sweep runs on two datasets, the 150 scenes of `shakespeare_char` (~1M characters, the
size of the paper's tiny-shakespeare) and its first 20 scenes (~0.16M), where the same number
of steps is ~7x as many epochs. Each run's val loss is logged every 150 steps; the table gives
its minimum, the step of the minimum, the last value and the rise from the minimum to the last.
"""
from __future__ import annotations

from pretrain.scaling.experiments.shakespeare_char import (SCENES, char_sweep,
                                                           write_char_results)
from pretrain.scaling.sweep import load_sweep

SWEEP = "configs/scaling/shakespeare_dropout.yaml"
SMALL_SCENES = 20


def main(overrides: list[str] = ()) -> int:
    sweep = load_sweep(SWEEP, overrides)
    rows = []
    for scenes in (SCENES, SMALL_SCENES):
        rows += char_sweep(SWEEP, scenes, list(overrides) + [f"name={sweep.name}-{scenes}scenes"])[1]
    write_char_results(sweep.directory, sweep.name, rows)
    return 0
