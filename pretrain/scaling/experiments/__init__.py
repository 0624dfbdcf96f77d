"""The papers' small experiments at CPU scale, one command each:

    python -m pretrain.scaling experiment listops           # NRGPT paper: ListOps accuracy
    python -m pretrain.scaling experiment shakespeare_char  # NRGPT paper: char-level Shakespeare
    python -m pretrain.scaling experiment ebt_thinking      # EBT paper: loss vs inference steps

Each trains its sweep (`configs/scaling/<name>.yaml`) through the ordinary sweep runner, so a
rerun skips finished runs and resumes an interrupted one; evaluates every run once (kept in
RUN_DIR/experiment_eval.json); and writes SWEEP_DIR/results/<name>.{md,csv,png}.
"""
EXPERIMENTS = ("listops", "shakespeare_char", "ebt_thinking")
