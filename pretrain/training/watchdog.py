"""A rank that is alive but stuck (a read from a hung network file system, a deadlocked data
worker) would leave its peers waiting in a collective for train.collective_timeout, and nobody
would learn where it was stuck. The watchdog, a thread beside the training loop, ends such a
rank: when no step completes within the limit, it writes every thread's stack to the rank's log
and exits with EXIT_HUNG, which the launcher's in-job restart treats as a crash.

The limit follows the steps seen: `train.hang_factor` times the slowest step so far, at least
`train.hang_min_s`; before a job's first two steps (compiling, the first batches) and around an
evaluation, a checkpoint save or a reload (`Watchdog.longer`) it is `train.hang_first_s`. A rank
whose loop is not reading data (computing, or inside a collective where it may be waiting for a
stuck peer) waits twice as long, so that the stuck rank, not those waiting for it, is the one
that reports."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
from typing import Iterator

from common.cli import write_exit_file

EXIT_HUNG = 124
"""A rank's exit code when its watchdog ended it (as timeout(1) exits)."""
FIRST_STEPS = 2
"""Steps that get `hang_first_s`: the first compiles; the second may still meet a cold cache."""


class Watchdog:
    def __init__(self, factor: float, min_s: float, first_s: float, rank: int):
        self.factor, self.min_s, self.first_s, self.rank = factor, min_s, first_s, rank
        self.slowest_step_s = 0.0
        self.steps = 0
        self.reading = False
        """True while the loop waits for its data (set by the trainer)."""
        self.limit_s = first_s
        self.since = time.monotonic()
        self._stopped = threading.Event()

    def start(self) -> None:
        """Watch from now on (the loop's start: setup, which may prepare a dataset, is not watched)."""
        self._restart(self.first_s)
        if self.factor:
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def step_done(self, step_s: float) -> None:
        self.steps += 1
        self.slowest_step_s = max(self.slowest_step_s, step_s)
        self._restart(self.first_s if self.steps < FIRST_STEPS else max(self.min_s, self.factor * self.slowest_step_s))

    @contextlib.contextmanager
    def longer(self) -> Iterator[None]:
        """Around work that is no step and may take far longer than one (an evaluation, a save)."""
        limit = self.limit_s
        self._restart(max(limit, self.first_s))
        try:
            yield
        finally:
            self._restart(limit)

    def stop(self) -> None:
        self._stopped.set()

    def _restart(self, limit_s: float) -> None:
        self.limit_s, self.since = limit_s, time.monotonic()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.min_s / 10)):
            waited = time.monotonic() - self.since
            if waited > self.limit_s * (1 if self.reading else 2):
                self._report(waited)

    def _report(self, waited: float) -> None:
        where = "reading its data" if self.reading else "computing or waiting in a collective"
        line = (f"error: rank {self.rank} on {socket.gethostname()} hung: no step completed in {waited:.0f} s "
                f"(the limit was {self.limit_s:.0f} s, train.hang_*), last seen {where}; every thread's stack "
                f"of this rank is above, exit code {EXIT_HUNG}")
        print(f"rank {self.rank}: watchdog: the stack of each thread, newest call last:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(line, file=sys.stderr, flush=True)
        write_exit_file(EXIT_HUNG, line)
        os._exit(EXIT_HUNG)  # the main thread is stuck: nothing else would end the process

