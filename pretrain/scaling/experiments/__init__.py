"""The papers' small experiments at CPU scale, one command each:

    python -m pretrain.scaling experiment listops           # NRGPT paper: ListOps accuracy
    python -m pretrain.scaling experiment shakespeare_char  # NRGPT paper: char-level Shakespeare
    python -m pretrain.scaling experiment shakespeare_dropout  # the same with the authors' dropout
    python -m pretrain.scaling experiment ebt_thinking      # EBT paper: loss vs inference steps
    python -m pretrain.scaling experiment isoflop           # scaling laws at equal compute

Each trains its sweep (`configs/scaling/<name>.yaml`, with `key=value` overrides as `run`
takes them) through the ordinary sweep runner, so a rerun skips finished runs and resumes an
interrupted one. All but `isoflop` evaluate every run once (kept in RUN_DIR/experiment_eval.json)
and write SWEEP_DIR/results/<name>.{md,csv,png}; `isoflop` writes the fits of
`python -m pretrain.scaling fit` to SWEEP_DIR/fit/.
"""
EXPERIMENTS = ("listops", "shakespeare_char", "shakespeare_dropout", "ebt_thinking", "isoflop")
