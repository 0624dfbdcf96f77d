"""One trainer per run directory. Two trainers on the same run would write the same checkpoints
and TensorBoard files, each believing the run is its own; so rank 0 holds an advisory lock on
the run for the whole job, and a second trainer stops before any work, naming the holder.

The lock is `flock` on `OUTPUT_ROOT/.<run_name>.lock`, beside the run directory rather than in
it, so that `resume=restart` can move the directory aside while it is held. The kernel releases
it when the holder's process ends in any way (kill -9 included; on NFS the server reclaims a
lost node's locks), so a requeued job never finds a stale lock. The file itself is never
removed (removing it would let two trainers lock two different files of the same name); it
holds the current holder's host, pid and start time, for the message.

A launcher's check (`--check`) only asks whether a trainer holds the run: it takes the lock
shared, for a moment, so that the checks of a job's nodes never fail each other, and a trainer
starting while a check holds it waits for the check to let go."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from pretrain.config import ConfigError

CHECK_WAIT_S = 10.0
"""How long a trainer waits for launchers' checks (shared holders, each for milliseconds) to let
go of the run before it counts them as another trainer."""


def lock_file(run_dir: Path) -> Path:
    return run_dir.with_name(f".{run_dir.name}.lock")


class RunLock:
    """The lock on one run directory, held from `acquire` until `release` (or the process ends)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = lock_file(run_dir)
        self.fd: int | None = None

    def acquire(self, create: bool = True, shared: bool = False) -> bool:
        """Take the lock (`shared`: a check's), or raise ConfigError naming the trainer that holds
        it. False where the file system cannot lock (e.g. Lustre mounted without `flock`): the
        run goes on unlocked, with a warning; and, without `create`, where there is no lock file
        (no trainer holds the run: a holder creates it)."""
        if not create and not self.path.is_file():
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        deadline = time.monotonic() + CHECK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    os.close(fd)
                    print(f"warning: {self.path}: the file system does not lock files ({os.strerror(e.errno)}); "
                          "nothing stops a second trainer on this run", file=sys.stderr, flush=True)
                    return False
                if not shared and time.monotonic() < deadline and _only_shared_holders(fd):
                    time.sleep(0.05)
                    continue
                holder = os.pread(fd, 1024, 0).decode(errors="replace").strip()
                os.close(fd)
                raise ConfigError(f"run_name={self.run_dir.name}: {self.run_dir} is in use by another trainer "
                                  f"({holder or 'starting up'}); wait for it to end or stop it, or choose another "
                                  "run_name") from None
        if not shared:
            started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n".encode(), 0)
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def _only_shared_holders(fd: int) -> bool:
    """Whether the lock `fd` could not take exclusively is held only shared (by checks)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def hold_run(run_dir: Path, rank: int, checking_only: bool = False) -> RunLock | None:
    """Rank 0 locks `run_dir` for the job and every rank raises the same error if another trainer
    holds it (collective once distributed). `checking_only` (a launcher's check before it starts
    the ranks) takes the lock shared and lets it go at once, creating nothing: only whether a
    trainer holds it matters."""
    lock, error = RunLock(run_dir), None
    if rank == 0:
        try:
            lock.acquire(create=not checking_only, shared=checking_only)
        except ConfigError as e:
            error = str(e)
    if dist.is_initialized():
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)
        error = outcome[0]
    if error is not None:
        raise ConfigError(error)
    if checking_only or rank != 0:
        lock.release()
        return None
    return lock
