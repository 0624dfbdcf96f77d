"""Scaling laws: sweeps of runs, the registry of finished runs, the fits and their plots.

    python -m pretrain.scaling run SWEEP.yaml [key=value ...] [--slurm]  # launch (or a job array)
    python -m pretrain.scaling list DIR...                # the runs found, and what is missing
    python -m pretrain.scaling fit DIR... [--out DIR]     # laws, IsoFLOP, joint law, gains
    python -m pretrain.scaling experiment NAME [key=value ...]  # a paper's small experiment
"""
