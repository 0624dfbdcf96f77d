"""One trainer per run directory. Two trainers on the same run would write the same checkpoints
and TensorBoard files, each believing the run is its own; so rank 0 holds an advisory lock on
the run for the whole job, and a second trainer stops before any work, naming the holder.

The lock is a POSIX record lock (`fcntl` F_SETLK) on `OUTPUT_ROOT/.<run_name>.lock`, beside the
run directory rather than in it, so that `resume=restart` can move the directory aside while it
is held. A record lock belongs to the process that took it, not to the open file: a child
forked afterwards (the DataLoader's workers, compile workers) inherits the descriptor but not
the lock, so the kernel releases it the moment the trainer itself ends, kill -9 included (on
NFS the server reclaims a lost node's locks), and a rerun at once finds it free. (An `flock`
lives on the open file description, which every forked child shares: a data worker that
outlived a killed trainer by seconds kept the run locked.) The price of record locks is that
closing any descriptor of the file releases them: only `RunLock` opens it, once per process.
The file itself is never removed (removing it would let two trainers lock two different files
of the same name); it holds the current holder's host, pid and start time, for the message.

A launcher's check (`--check`) only asks whether a trainer holds the run: it takes the lock
shared, for a moment, so that the checks of a job's nodes never fail each other, and a trainer
starting while a check holds it waits for the check to let go."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import sys
import time
from pathlib import Path

import torch.distributed as dist

from pretrain.config import ConfigError

CHECK_WAIT_S = 10.0
"""How long a trainer waits for launchers' checks (shared holders, each for milliseconds) to let
go of the run before it counts them as another trainer."""

_FLOCK = "@hhqqi4x"
"""struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (with its padding, as the
kernel lays it out on 64-bit hosts)."""


def lock_file(run_dir: Path) -> Path:
    return run_dir.with_name(f".{run_dir.name}.lock")


def lock_whole_file(fd: int, kind: int) -> None:
    """Take (F_RDLCK, F_WRLCK) or let go of (F_UNLCK) this process's record lock on the whole
    file `fd`, without waiting: OSError EAGAIN/EACCES where another process holds a conflicting
    one."""
    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))


def conflicting_holder(fd: int, kind: int) -> tuple[int, int] | None:
    """(lock type, pid) of a process whose lock on `fd` keeps this one from taking `kind`; None
    where nothing does. The pid is the kernel's and current: 0 or a remote number for a holder on
    another NFS client."""
    found = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    lock_type, _, _, _, pid = struct.unpack(_FLOCK, found)
    return None if lock_type == fcntl.F_UNLCK else (lock_type, pid)


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
        kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
        deadline = time.monotonic() + CHECK_WAIT_S
        while True:
            try:
                lock_whole_file(fd, kind)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    print(f"warning: {self.path}: the file system does not lock files ({os.strerror(e.errno)}); "
                          "nothing stops a second trainer on this run", file=sys.stderr, flush=True)
                    return False
                holder = conflicting_holder(fd, kind)
                if holder is None:  # let go in between: try again
                    continue
                if not shared and time.monotonic() < deadline and holder[0] == fcntl.F_RDLCK:
                    time.sleep(0.05)  # a launcher's check: it lets go in milliseconds
                    continue
                recorded = os.pread(fd, 1024, 0).decode(errors="replace").strip()
                os.close(fd)
                raise ConfigError(f"run_name={self.run_dir.name}: {self.run_dir} is in use by "
                                  f"{describe_holder(recorded, holder[1])}; wait for it to end or stop it, "
                                  "or choose another run_name") from None
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


def describe_holder(recorded: str, holder_pid: int) -> str:
    """Who holds the run, for the error line: the trainer the lock file names (`recorded`: host,
    pid, start), or, where that trainer is a process of this host that no longer runs, the
    process the kernel names as the holder instead."""
    fields = dict(part.strip().split(" ", 1) for part in recorded.split(",") if " " in part.strip())
    here = fields.get("host") == socket.gethostname()
    recorded_pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else None
    if here and recorded_pid is not None and recorded_pid != holder_pid and not _alive(recorded_pid):
        return (f"pid {holder_pid} ({_command(holder_pid)}), not by the trainer the lock file names "
                f"({recorded}), which has ended")
    return f"another trainer ({recorded or 'starting up'})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError too means that it runs (as another user)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "a process of another user or host"
    return " ".join(arg.decode(errors="replace") for arg in argv if arg)[:200] or "unknown command"


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
