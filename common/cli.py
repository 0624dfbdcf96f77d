"""What every command does at its edges, so that none ends in a traceback there: a malformed
command line is one error line, Ctrl-C stops it with one line on stderr and exit status 130 (also
while it is still importing), a scheduler's SIGTERM or SIGUSR1 with one line and 128 + the
signal's number, and a reader of its output that goes away (`| head`) stops it quietly. (The
trainer handles its own signals once started: it saves a checkpoint first.)"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator, NoReturn

INTERRUPTED = 130
"""128 + SIGINT: what a shell reports for a command stopped by Ctrl-C."""
READER_GONE = 141
"""128 + SIGPIPE: what a shell reports for a command whose output pipe was closed."""
INTERRUPTED_LINE = "error: interrupted"
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""A scheduler's stop: SIGTERM (preemption, scancel) and SIGUSR1 (the warning before the time
limit)."""
STOP_SIGNALS = (*SCHEDULER_SIGNALS, signal.SIGINT)
"""What stops a command: a scheduler's signals and Ctrl-C."""
EXIT_DIR_VARIABLE = "PRETRAIN_EXIT_DIR"
"""Set by the launcher (`pretrain.torchrun`): where each rank writes its exit code and error line
before exiting (a file named by its rank)."""


ATTEMPT_VARIABLE = "PRETRAIN_ATTEMPT"
"""Set by the launcher (`pretrain.torchrun`) for each start of the workers, the same on every
node: the namespace of the attempt's keys in torchrun's store, which outlives a restart (see
`pretrain.training.engine.init_distributed`)."""


class Stopped(BaseException):
    """A stop signal, raised where the process was. A BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: a usage error is one `error: ...` line and status 2, like every
    other bad input (argparse would print its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def say_stopped(line: str = INTERRUPTED_LINE) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets the signal
        print(f"\n{line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold the STOP_SIGNALS during the block: they are delivered, and their handlers run, when
    it ends. For steps that an exception raised by a handler would leave half-done: a process
    pool's first submit starts its workers, then its manager thread, and interrupted in between
    the pool cannot be shut down. Processes forked inside the block inherit the hold, and must
    clear it.

    Blocking the signals is not enough: another thread (one that does not block them) can take
    a signal, and Python then runs the handler in the main thread at its next chance, inside
    the block (even inside a fork's at-fork hooks, where the exception is lost). So the block
    also swaps in handlers that only note the signal, and delivers the noted ones again at its
    end, to the handlers it restores."""
    noted: list[int] = []
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    previous_handlers = {}
    try:
        for signum in STOP_SIGNALS:
            previous_handlers[signum] = signal.signal(signum, lambda signum, frame: noted.append(signum))
        yield
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for signum in noted:
            signal.raise_signal(signum)


@contextlib.contextmanager
def stop_signals_raising(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """During the block the first of `signals` raises `Stopped` where the process is, and the ones
    after it are ignored: the process then cleans up and reports without being stopped again
    halfway. The handlers before it are restored after it. (Processes forked inside a
    `signals_held` block inherit the hold; the block lifts it.) A process forked inside the
    block inherits the handler, but not the block's cleanup: it dies of the signal instead, as
    it would have without the block."""
    pid = os.getpid()

    def on_signal(signum, frame) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for stop_signal in signals:
            signal.signal(stop_signal, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in signals}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_command(main: Callable[[], int | None]) -> None:
    """Exit with main()'s status, or with one of the codes above instead of a traceback."""
    try:
        with stop_signals_raising(SCHEDULER_SIGNALS):
            code = main() or 0
    except Stopped as stop:
        say_stopped(f"error: stopped by {signal.Signals(stop.signum).name}")
        code = 128 + stop.signum
    except KeyboardInterrupt:
        say_stopped()
        code = INTERRUPTED
    except BrokenPipeError:
        # nothing more can be shown; the interpreter's last flush of stdout would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = READER_GONE
    sys.exit(code)


def write_exit_file(code: int, line: str = "") -> None:
    """Called by every rank of the trainer as it exits: its code and error line for the launcher."""
    directory = os.environ.get(EXIT_DIR_VARIABLE)
    if directory:
        Path(directory, os.environ.get("RANK", "0")).write_text(f"{code}\n{line}")


def end_interrupted_starts_in_one_line() -> None:
    """Called by the packages' `__init__`. A command's module imports torch and DeepSpeed for
    seconds before its main() runs, so a Ctrl-C then is caught by nobody and Python prints a
    traceback of importlib frames. This ends such a Ctrl-C as `run_command` ends one: the line,
    status 130, and the code the torchrun launcher reads. It acts only while Python is starting a
    `python -m` command (sys.argv[0] is "-m" while the module is being located, as documented),
    so a program that imports the package keeps Python's own handling."""
    if sys.argv[:1] != ["-m"] or sys.excepthook is not sys.__excepthook__:
        return

    def on_uncaught(kind, value, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, traceback)
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards the same Ctrl-C again
        say_stopped()
        write_exit_file(INTERRUPTED, INTERRUPTED_LINE)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(INTERRUPTED)  # the command had not started: nothing of its own to clean up

    sys.excepthook = on_uncaught
