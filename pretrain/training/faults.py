"""Test-only fault injection (config section `fault`): what the tests of the trainer's recovery
from non-finite updates inject into a real run."""
from __future__ import annotations

import math

import torch

from pretrain.config import FaultSection


class Faults:
    def __init__(self, fault: FaultSection, rank: int):
        self.fault, self.rank = fault, rank
        self.fired: set[int] = set()

    def loss(self, loss: torch.Tensor, step: int, last_micro: bool) -> torch.Tensor:
        """A NaN loss on one rank, or a spike on every rank, once per listed step (a reload after
        non-finite updates passes the same steps again, without the fault)."""
        if step in self.fired:
            return loss
        if step in self.fault.nan_loss_steps and self.rank == self.fault.nan_loss_rank:
            self.fired.add(step)
            return loss * math.nan
        if step in self.fault.spike_loss_steps:
            if last_micro:  # every micro-batch of the step spikes
                self.fired.add(step)
            return loss * self.fault.spike_loss_factor
        return loss
