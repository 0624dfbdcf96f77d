"""Test-only fault injection (config section `fault`): what the tests of the trainer's recovery
from non-finite updates inject into a real run, the hold at a given step that the multi-node
tests cut or kill a node in, and a rank's data read that hangs or lags (the watchdog's and the
straggler warning's tests)."""
from __future__ import annotations

import math
import os
import threading
import time

import torch

from pretrain.config import FaultSection
from pretrain.training.stopping import StopSignals


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

    def hold(self, step: int, stops: StopSignals) -> None:
        """Waits before optimizer `step` while `fault.step_stall_file` holds it, until a stop
        signal arrives (a held run is preempted as a running one is: it runs the step and saves)."""
        path = self.fault.step_stall_file
        while path and step >= self.fault.step_stall_from and os.path.exists(path) and not stops.signum:
            time.sleep(0.1)

    def read(self, step: int) -> None:
        """Before optimizer `step`'s data read: this rank lags (`slow_rank`), or blocks forever
        (`hang_read_rank`, in the job's first start of its ranks: an in-job restart reads on)."""
        fault = self.fault
        if self.rank == fault.slow_rank:
            time.sleep(fault.slow_rank_s)
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.rank == fault.hang_read_rank and step == fault.hang_read_step and first_start:
            stuck_network_read()


def stuck_network_read() -> None:
    """What a read from a hung network file system does: never return (the name the watchdog's
    stack dump shows)."""
    threading.Event().wait()
