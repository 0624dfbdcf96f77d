"""Probes of the descent: what a recurrent model's state and an energy-based model's energies do
step by step, read without changing what the models compute (a forward hook on the shared block,
and the outputs the models already return). The dynamics command (`pretrain.dynamics`) and the
evaluation during training (`eval.dynamics`) both measure with these."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn

from pretrain.models.blocks import token_losses, wide
from pretrain.models.registry import FAMILIES


def descending_families() -> list[str]:
    """The families whose forward is a descent, which these probes measure (the others have none)."""
    return [name for name, spec in FAMILIES.items() if spec.descends]

MONOTONE_SLACK = 64
"""A rise of a token's energy smaller than this many float32 roundings of its largest |energy|
is rounding, not a rise."""


@contextlib.contextmanager
def after_each_step(model: nn.Module, on_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
                    ) -> Iterator[None]:
    """During the block, every application of the recurrent block (`model.block`, shared by
    the steps of gpt_rec and NRGPT) calls on_step(state before, state after); a tensor it
    returns replaces the state after. A forward hook: the models compute what they always do."""
    def hook(module, args, output):
        returned = isinstance(output, tuple)  # NRGPT's block returns (state, energies or None)
        replaced = on_step(args[0], output[0] if returned else output)
        if replaced is None:
            return None
        return (replaced, *output[1:]) if returned else replaced

    handle = model.block.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def relative_update(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """[B, T] ||x_{s+1} - x_s|| / ||x_s|| per token, in float32 at least."""
    return wide(after - before).norm(dim=-1) / wide(before).norm(dim=-1)


def readout_losses(model: nn.Module, state: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token loss of reading out `state` (final norm and LM head, as the forward)."""
    return token_losses(model.lm_head(model.ln_f(state)), targets)


@contextlib.contextmanager
def read_out_each_step(model: nn.Module, targets: torch.Tensor, positions: slice = slice(None)
                       ) -> Iterator[dict[str, list[torch.Tensor] | torch.Tensor]]:
    """During the block, a gpt_rec or NRGPT forward reads out its state after every step at the
    sequence `positions` (all by default; a strided subset bounds the cost of the extra LM
    heads). Yields the record it fills: `losses`, per step the [B, T'] loss of that readout
    against targets[:, positions]; `updates`, per step the [B, T] relative update; for NRGPT
    `final_energy`, each token's own energy [B, T] at the final state. All is computed as the
    steps run, inside the forward (where ZeRO-3 has gathered the block's parameters), and no
    state is kept."""
    record: dict = {"losses": [], "updates": []}
    targets = targets[:, positions]
    nrgpt = hasattr(model, "recurrence")

    def on_step(before: torch.Tensor, after: torch.Tensor) -> None:
        record["losses"].append(readout_losses(model, after[:, positions], targets))
        record["updates"].append(relative_update(before, after))
        if nrgpt and len(record["updates"]) == model.config.n_steps:
            record["final_energy"] = model.block.energy(model.block.norm(after))

    with after_each_step(model, on_step):
        yield record


def state_energies(entering: torch.Tensor, record: dict) -> torch.Tensor:
    """[S + 1, B, T] each token's own energy at the states 0..S of an NRGPT forward: those of
    the states entering each step (`_token_energy` of a forward with return_energies) and the
    final state's from a `read_out_each_step` record."""
    return torch.cat([entering, record["final_energy"].unsqueeze(0).to(entering.dtype)])


def never_rising(energies: torch.Tensor, transient: int) -> torch.Tensor:
    """[N...] whether each token's energy (`energies` [S + 1, N...], states 0..S) never rises
    from state `transient` on (by more than MONOTONE_SLACK roundings)."""
    exact = energies.double()
    slack = MONOTONE_SLACK * torch.finfo(torch.float32).eps * exact.abs().amax(dim=0)
    return ~(exact[transient + 1:] - exact[transient:-1] > slack).any(dim=0)


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 1..N of a 1-D tensor, tied values sharing the mean of their ranks."""
    _, inverse, counts = torch.unique(values, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()
    return (last - (counts.double() - 1) / 2)[inverse]


def rank_correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation of two 1-D tensors (Pearson's of their average ranks), as a
    float64 scalar; 0 where either has a single distinct value."""
    rx, ry = average_ranks(x.flatten()), average_ranks(y.flatten())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    scale = (rx.square().sum() * ry.square().sum()).sqrt()
    return torch.where(scale > 0, (rx * ry).sum() / scale.clamp(min=1e-300), 0.0)
