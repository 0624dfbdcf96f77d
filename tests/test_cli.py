"""common.cli: the edges every command shares."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import trainer_runs as runs
from common.cli import Stopped, signals_held, stop_signals_raising


def test_a_held_block_runs_to_its_end_when_another_thread_takes_the_signal():
    """The main thread blocks the signal, so the kernel hands it to a thread that does not; Python
    would then run the handler in the main thread inside the block (in prepare this broke a
    process pool's start half-way and the command hung). The stop must come after the block."""
    go = threading.Event()
    sender = threading.Thread(target=lambda: (go.wait(), os.kill(os.getpid(), signal.SIGTERM)))
    sender.start()  # before the block, so that it does not inherit the hold
    before = signal.getsignal(signal.SIGTERM)
    finished = []
    with pytest.raises(Stopped) as stopped:
        with stop_signals_raising((signal.SIGTERM,)):
            with signals_held():
                go.set()
                sender.join()
                for _ in range(1000):  # many chances for a pending handler to run
                    time.sleep(0)
                finished.append("the block")
            finished.append("after it")  # the stop comes here, not later
    assert finished == ["the block"] and stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


COMMAND = """
import os, sys, time
from common.cli import run_command

def wait():  # short sleeps: a signal just before one is handled when it ends
    for _ in range(1200):
        time.sleep(0.05)

def main():
    child = os.fork()
    if child == 0:  # a worker of the command: it inherits the command's handlers
        print(os.getpid(), flush=True)  # once running: Python drops a signal taken inside fork()
        wait()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else f"exited {os.WEXITSTATUS(status)}", flush=True)
    wait()

run_command(main)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_scheduler_signal_ends_a_command_in_one_line_and_kills_its_forked_workers(signum):
    """A command (sample, export, evaluate, a sweep) stopped by the scheduler says so in one line
    and exits with 128 + the signal's number. A process it forked dies of the signal, as it did
    before the command had a handler, instead of running the command's ending too."""
    command = subprocess.Popen([sys.executable, "-c", COMMAND], cwd=runs.REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        worker = int(command.stdout.readline())
        os.kill(worker, signum)
        assert command.stdout.readline().strip() == str(int(signum))
        command.send_signal(signum)
        out, err = command.communicate(timeout=30)
    finally:
        command.kill()
    assert command.returncode == 128 + signum
    assert err.strip() == f"error: stopped by {signal.Signals(signum).name}"
