"""The trainer's command line on every rank (`pretrain.train.main`), one rank failing on purpose
as its setup reaches the engine: an error only that rank meets, while the others go on into
DeepSpeed's engine set-up and wait there for it.

    python -m pretrain.torchrun --nproc_per_node=2 ... tests/failing_rank_worker.py RANK STAMP \
        --config ... [key=value ...]

The failing rank writes the time it fails (time.time()) to the file STAMP."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain import train  # noqa: E402
from pretrain.config import ConfigError  # noqa: E402
from pretrain.training import trainer  # noqa: E402

FAILING_RANK, STAMP = int(sys.argv[1]), Path(sys.argv[2])


class FailingTrainer(trainer.Trainer):
    def build_engine(self, dataset_vocab_size: int) -> None:
        if self.rank == FAILING_RANK:
            STAMP.write_text(str(time.time()))
            raise ConfigError(f"rank {self.rank} fails on purpose")
        super().build_engine(dataset_vocab_size)


trainer.Trainer = FailingTrainer  # the class trainer.run builds
sys.exit(train.main(sys.argv[3:]))
