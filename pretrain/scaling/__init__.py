"""Scaling laws: sweeps of runs, the registry of finished runs, power-law fits and plots.

    python -m pretrain.scaling run SWEEP.yaml [--slurm]  # launch (or write a job array)
    python -m pretrain.scaling list DIR...               # the runs found, and what is missing
    python -m pretrain.scaling fit DIR... [--out DIR]    # fits, table, figure, TensorBoard
    python -m pretrain.scaling experiment NAME           # a paper's small experiment
"""
