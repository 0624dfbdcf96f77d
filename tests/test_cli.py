"""common.cli: the edges every command shares."""
import os
import signal
import threading
import time

import pytest

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
