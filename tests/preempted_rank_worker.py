"""Two ranks that end as the trainer's do after a stop signal: both exit with 75 (checkpoint
saved), rank 0 only after the others, because it still completes the checkpoint and prunes the
old ones (here: a sleep of SECONDS, then the file DONE).

    python -m pretrain.torchrun --nproc_per_node=2 ... tests/preempted_rank_worker.py SECONDS DONE"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import write_exit_file  # noqa: E402
from pretrain.training.stopping import EXIT_PREEMPTED  # noqa: E402

SECONDS, DONE = float(sys.argv[1]), Path(sys.argv[2])

if os.environ["RANK"] == "0":
    time.sleep(SECONDS)
    DONE.write_text("pruned")
write_exit_file(EXIT_PREEMPTED)
sys.exit(EXIT_PREEMPTED)
