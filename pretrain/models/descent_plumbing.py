"""Engine plumbing of the EBT descent, kept apart from its math (`ebt.py`): activation
checkpointing of a step that itself calls autograd.grad, the RNG handling it needs to rerun a
step with the same noise, and the settings a step runs with."""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


def energy_settled(before: torch.Tensor, after: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Where a descent step changed the energy by less than `tolerance` times the energy before
    it (the per-position stop of `EnergyDescent.forward`)."""
    return (after - before).abs() < tolerance * before.abs()


class StepSettings(NamedTuple):
    """How one descent step runs."""

    first_row: int
    """Position of the first predicted row in the sequence (0 for a whole sequence)."""
    noise_std: float
    """Std of the Langevin noise added to the candidate before the step (0: none)."""
    second_order: bool
    """Build the graph of the energy gradient, so the loss can be differentiated through it."""
    keep_graph: bool
    """Keep the graph through the incoming candidate (S2), instead of detaching it (S1)."""


class CheckpointedStep(torch.autograd.Function):
    """Activation checkpointing of one descent step, a function that calls autograd.grad (EBT
    with its double-backward energy gradient; the first-order one takes torch's checkpoint).

    Forward runs the step without its second-order graph and keeps only the step's inputs;
    backward reruns it with the graph (same random numbers) and backpropagates. torch's
    non-reentrant checkpoint would instead recompute the dropped activations already in the
    forward, for the step's own autograd.grad, and then keep what that gradient does not read
    until the backward: one more [B, T, V] tensor per step, and an extra energy forward.
    The parameters are inputs (unused in forward) so that their gradients flow through the
    usual accumulation, and its hooks (DeepSpeed's).

    `step(y, observed, targets, alpha, settings) -> (y_next, energy, per-token losses)` is the
    descent step (`EnergyDescent.step`); `observed_and_params` are the observed stream's keys and
    values (flattened, `n_observed` tensors) followed by the trainable parameters."""

    @staticmethod
    def forward(ctx, step, settings: StepSettings, n_observed: int, targets, y, alpha, *observed_and_params):
        observed_flat, ctx.params = observed_and_params[:n_observed], observed_and_params[n_observed:]
        ctx.step, ctx.settings, ctx.targets = step, settings, targets
        ctx.rng = rng_state(y.device)
        ctx.save_for_backward(y, alpha, *observed_flat)
        without_graph = settings._replace(second_order=False, keep_graph=False)
        with torch.enable_grad():
            y, energy, losses = step(y.detach(), pairs(observed_flat), targets, alpha.detach(), without_graph)
        return y.detach(), energy, None if losses is None else losses.detach()

    @staticmethod
    def backward(ctx, grad_y, grad_energy, grad_losses):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        y, alpha, *observed_flat = inputs
        with torch.random.fork_rng(devices=[y.device] if y.is_cuda else []), torch.enable_grad():
            restore_rng_state(ctx.rng, y.device)
            y, _, losses = ctx.step(y, pairs(observed_flat), ctx.targets, alpha, ctx.settings)
        outputs = [(out, grad) for out, grad in ((y, grad_y), (losses, grad_losses))
                   if grad is not None and out is not None and out.requires_grad]
        wrt = [t for t in inputs + list(ctx.params) if t.requires_grad]
        grads = [None] * len(wrt)
        if outputs:
            grads = torch.autograd.grad([o for o, _ in outputs], wrt, [g for _, g in outputs],
                                        allow_unused=True)
        grads = iter(grads)
        return (None, None, None, None,
                *(next(grads) if t.requires_grad else None for t in inputs + list(ctx.params)))


def rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def restore_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device):
    """Inside: the global RNG of the CPU (and of `device`) seeded with `seed`; restored after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.default_generators[device.index if device.index is not None
                                          else torch.cuda.current_device()].manual_seed(seed)
        yield


def pairs(flat) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(flat[0::2], flat[1::2]))
