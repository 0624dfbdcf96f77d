"""What a stop signal does to a training run, before and during the loop.

                        before the first step (setup)          in the loop
    SIGTERM, SIGUSR1    stops setup at once: StoppedInSetup,   finish the step, save a
                        exit 75 (nothing trained, nothing      checkpoint, exit 75
                        lost; setup can take hours)
    Ctrl-C (SIGINT)     stops setup at once: exit 130          the same; Ctrl-C again (after
                                                               REPEAT_SIGINT_S) aborts without
                                                               saving: Aborted, exit 130

Slurm sends SIGUSR1 as the warning before a time limit and SIGTERM on preemption or scancel; a
terminal's Ctrl-C reaches every process of the job. In the loop the handler only notes the
signal; the trainer carries it in its per-step all-reduce, so every rank stops after the same
step. 75 (EX_TEMPFAIL) asks a scheduler to requeue: the rerun resumes from the checkpoint."""
from __future__ import annotations

import os
import signal
import sys
import time

from common.cli import INTERRUPTED, INTERRUPTED_LINE, STOP_SIGNALS, Stopped

EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1/SIGINT after saving a checkpoint (or by SIGTERM/SIGUSR1
before the first step, with nothing to save); rerun to resume."""
EXIT_ABORTED = INTERRUPTED
"""A second Ctrl-C: stopped at once, without saving (the last checkpoint stays the resume point)."""
REPEAT_SIGINT_S = 2.0
"""A Ctrl-C this long after the first aborts at once. Sooner ones are the same keypress arriving
twice (the terminal signals the whole process group and torchrun forwards it again)."""


class Aborted(Exception):
    """Ctrl-C pressed again while the trainer was finishing its step to save."""


class StoppedInSetup(Stopped):
    """SIGTERM or SIGUSR1 before the first step, raised where setup was (Ctrl-C raises
    KeyboardInterrupt)."""


class StopSignals:
    """The trainer's handler of the STOP_SIGNALS, from construction until `restore`."""

    def __init__(self, rank: int):
        self.rank = rank
        self.signum = 0
        """The stop signal received (0: none yet)."""
        self.time = 0.0
        self.looping = False
        """True from the first step on: a stop signal then saves after the step."""
        self.pid = os.getpid()
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # a process forked from the trainer (the data preparation's tokenizers, loader
            # workers) keeps this handler: the stop is the trainer's to make, not theirs
            return
        if not self.looping:
            if not self.signum:  # the same keypress delivered twice stops setup once
                self.signum = signum
                raise KeyboardInterrupt if signum == signal.SIGINT else StoppedInSetup(signum)
            return
        if self.signum and signum == signal.SIGINT and time.monotonic() - self.time > REPEAT_SIGINT_S:
            raise Aborted()
        if not self.signum:
            self.signum, self.time = signum, time.monotonic()
            if signum == signal.SIGINT and self.rank == 0:
                print("interrupted: finishing this step and saving a checkpoint (Ctrl-C again to "
                      "abort without saving)", file=sys.stderr, flush=True)

    def cause(self) -> str:
        """What stopped the loop: this rank's signal, or another rank's (the all-reduced flag)."""
        return signal.Signals(self.signum).name if self.signum else "another rank's signal"

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def ignore_stop_signals(worker_id: int) -> None:
    """`worker_init_fn` of the loader's workers: a scheduler signals every process of the job,
    and a worker dead of SIGTERM would fail the batch the step still needs."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def stopped_line(stop: BaseException) -> tuple[str, int]:
    """The error line and exit code of a run ended by `stop` (Aborted, StoppedInSetup or a
    KeyboardInterrupt before the first step, or before the handler was installed)."""
    if isinstance(stop, Aborted):
        return ("error: interrupted again: stopped without saving; rerun the same command to resume "
                "from the last checkpoint"), EXIT_ABORTED
    if isinstance(stop, StoppedInSetup):  # 75, the requeue code: the rerun starts where this one would have
        return (f"error: stopped by {signal.Signals(stop.signum).name} while setting up, before the first "
                "step (nothing to save); rerun the same command to resume"), EXIT_PREEMPTED
    return INTERRUPTED_LINE, INTERRUPTED
