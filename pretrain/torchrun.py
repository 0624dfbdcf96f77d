"""torchrun, reporting a failed launch the way the trainer does: in one line, with its exit code.

    python -m pretrain.torchrun [torchrun options] -m pretrain.train --config ... [key=value ...]

`launch/torchrun.sh` runs this instead of plain torchrun. It is torchrun itself (the same
options, rendezvous, signal forwarding and worker restarts), with two changes for the way the
trainer fails: the trainer's ranks already print one `error: ...` line (rank 0) and exit with a
meaningful code (2 config/data, 1 training error, 75 checkpoint saved after a signal, 130 Ctrl-C
twice), so torchrun's own 40-line ChildFailedError report is left out, and this process exits
with the code of the node's first rank (written to PRETRAIN_EXIT_FILE by the trainer) instead of
torchrun's 1. torchrun's log lines are kept back and shown only when a worker died without saying
why (killed by a signal, or exited without writing its code)."""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

EXIT_FILE_VARIABLE = "PRETRAIN_EXIT_FILE"
"""Where the trainer's first local rank writes its exit code (and error line) before exiting."""


class _Held(logging.Handler):
    """Keeps torchrun's log records to show only if the failure needs them."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def write_exit_file(code: int, line: str = "") -> None:
    """Called by the trainer's first local rank as it exits: its code for this launcher."""
    path = os.environ.get(EXIT_FILE_VARIABLE)
    if path and os.environ.get("LOCAL_RANK", "0") == "0":
        Path(path).write_text(f"{code}\n{line}")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    held = _Held()
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(held)
    elastic.propagate = False
    with tempfile.TemporaryDirectory(prefix="pretrain-torchrun-") as tmp:
        exit_file = Path(tmp) / "exit_code"
        os.environ[EXIT_FILE_VARIABLE] = str(exit_file)
        failure = None
        try:
            torchrun_main(argv)
            torchrun_code = 0
        except ChildFailedError as e:
            failure, torchrun_code = e, 1
        except SignalException as e:  # torchrun was signalled; its workers had the grace period
            failure, torchrun_code = e, 128 + int(e.sigval)
        if exit_file.is_file():
            return int(exit_file.read_text().split("\n", 1)[0])
    if failure is not None:
        # the trainer did not say how it ended: show what torchrun knows
        for record in held.records:
            print(held.format(record), file=sys.stderr)
        print(f"error: torchrun: {_describe(failure)}", file=sys.stderr)
    return torchrun_code


def _describe(failure: Exception) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(failure, ChildFailedError):
        rank, first = failure.get_first_failure()
        how = f"died of {first.signal_name()}" if first.exitcode < 0 else f"exited with code {first.exitcode}"
        return (f"rank {rank} (pid {first.pid} on {first.hostname}) {how} without reporting an error; "
                "its own output above says more")
    return f"stopped by signal {failure.sigval} before the trainers reported how they ended"


if __name__ == "__main__":
    sys.exit(main())
