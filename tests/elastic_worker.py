"""Runs of the elastic-resume tests, several in one launch (one process, or each rank under
torchrun), with a record of the training windows each run consumed.

    python tests/elastic_worker.py PLAN.json      (torchrun ... tests/elastic_worker.py PLAN.json)

PLAN.json: {"config": base config file, "runs": [{"overrides": [...], "record": path}, ...]}.
Each run is the real trainer (`pretrain.training.trainer.Trainer`: setup, train, close), observed by a
subclass that notes, for every micro-batch it takes from the loader, the optimizer step it
belongs to and the window (inputs plus the last target). Rank r writes `record.rank{r}.json`:
{"code": exit code or null, "error": one-line ConfigError or null, "windows": [[step, [tokens]], ...]}.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.config import ConfigError, load_config  # noqa: E402
from pretrain.config.validation import validate  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


class RecordingTrainer(Trainer):
    """The trainer, noting every window it trains on (nothing else changes)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.windows: list[tuple[int, list[int]]] = []

    def _restart_batches(self) -> None:
        super()._restart_batches()
        self.batches = _Recorded(self.batches, self)


class _Recorded:
    def __init__(self, batches, trainer: RecordingTrainer):
        self.batches, self.trainer = batches, trainer

    def __next__(self):
        inputs, targets = next(self.batches)
        step = self.trainer.state.step + 1  # the optimizer step this micro-batch is part of
        for row_in, row_out in zip(inputs.tolist(), targets.tolist()):
            self.trainer.windows.append((step, row_in + row_out[-1:]))
        return inputs, targets

    def close(self) -> None:
        self.batches.close()


def run(config: str, overrides: list[str], record: str) -> None:
    result = {"code": None, "error": None, "windows": []}
    trainer = None
    try:
        cfg = load_config(config, overrides)
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), has_gpu=False)
        trainer = RecordingTrainer(cfg)
        trainer.setup()
        result["code"] = trainer.train()
    except ConfigError as e:
        result["error"] = str(e)
    finally:
        if trainer is not None:
            result["windows"] = trainer.windows
            trainer.close()
    Path(f"{record}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    for item in plan["runs"]:
        run(plan["config"], item["overrides"], item["record"])


if __name__ == "__main__":
    main()
