"""Downstream evaluation inside a training run (`eval.downstream`): the first `limit` documents
of each task, the same ones every time, evaluated on every rank with identical calls (ZeRO-3's
forward gathers parameters collectively); the scalars go to TensorBoard as the command's do."""
from __future__ import annotations

from typing import Callable

import torch

from pretrain.config import DownstreamSection
from pretrain.downstream import harness


def due(settings: DownstreamSection, step: int, final: bool) -> bool:
    return bool(settings.tasks) and (final or (settings.interval > 0 and step % settings.interval == 0))


def evaluate_in_training(model: torch.nn.Module, settings: DownstreamSection, manifest: dict, step: int,
                         final: bool, log: Callable[[int, dict[str, float]], None]) -> dict[str, float]:
    """When due at `step`, evaluate `model` (the training module; its train/eval mode is kept),
    `log(step, scalars)` and return the scalars; otherwise {}."""
    if not due(settings, step, final):
        return {}
    from data_pipeline.tokenizer import tokenizer_from_spec
    from pretrain.downstream.adapter import HarnessModel  # imports lm-eval: only when used

    adapter = HarnessModel(model, tokenizer_from_spec(manifest), batch_size=settings.batch_size,
                           split_over_ranks=False, progress=False)
    values = harness.scalars(harness.run(adapter, settings.tasks, settings.limit))
    log(step, values)
    return values
