"""What every command does at its edges, so that none ends in a traceback there: Ctrl-C stops it
with one line on stderr and exit status 130, and a reader of its output that goes away (`| head`)
stops it quietly. (The trainer handles its own signals: it saves a checkpoint first.)"""
from __future__ import annotations

import os
import sys
from typing import Callable

INTERRUPTED = 130
"""128 + SIGINT: what a shell reports for a command stopped by Ctrl-C."""
READER_GONE = 141
"""128 + SIGPIPE: what a shell reports for a command whose output pipe was closed."""


def run_command(main: Callable[[], int | None]) -> None:
    """Exit with main()'s status, or with one of the two above instead of a traceback."""
    try:
        code = main() or 0
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets the signal
            print("\nerror: interrupted", file=sys.stderr, flush=True)
        code = INTERRUPTED
    except BrokenPipeError:
        # nothing more can be shown; the interpreter's last flush of stdout would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = READER_GONE
    sys.exit(code)
