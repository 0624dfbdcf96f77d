"""A checkpoint's writes as DeepSpeed makes them, recorded: each file hashed as it is written,
the first failed write kept (and the rest skipped) so that every rank can agree on it, and the
bytes the checkpoint needs, written or not."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import xxhash

from common.fileio import atomic_write


@dataclass
class WriteFailure:
    """The first write of a checkpoint that failed on a rank."""

    path: str
    reason: str
    """The operating system's words for it (or torch's, when its writer hides the OS error)."""
    out_of_space: bool


class RecordedWrites:
    """DeepSpeed's checkpoint engine for one save, which does not raise: the first failed write
    is kept in `failure` and later writes are skipped. DeepSpeed's save_checkpoint runs
    collectives between its writes (the tag check, barriers), so a rank that raised out of it
    would leave the others waiting for it; the ranks compare their failures once it returns.
    `bytes` counts what every file takes, written or not: the space the checkpoint needs."""

    def __init__(self, inner):
        self.inner = inner
        self.failure: WriteFailure | None = None
        self.bytes = 0
        self.written: dict[str, list] = {}
        """Path -> [size, xxh3-64 digest] of each file, hashed as it was written."""

    def __getattr__(self, name):  # the rest of the checkpoint engine's interface, unchanged
        return getattr(self.inner, name)

    def save(self, state_dict, path) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        if isinstance(self.inner, TorchCheckpointEngine):  # torch.save, which takes a file object too
            self.write(path, lambda: self._hashed(path, path, lambda f: self.inner.save(state_dict, f)), state_dict)
        else:
            self.write(path, lambda: self.inner.save(state_dict, path), state_dict)

    def save_atomically(self, state, path: Path) -> None:
        """torch.save `state` to `path` (which appears only when complete), hashed as written."""
        def dump(tmp: Path) -> None:
            self._hashed(path, tmp, lambda f: torch.save(state, f))

        self.write(path, lambda: atomic_write(path, dump), state)

    def _hashed(self, path, target, dump) -> None:
        """dump(file) writes `target`, hashed on the way and recorded for `path`."""
        with open(target, "wb") as f:
            hashing = _HashingFile(f)
            dump(hashing)
        self.written[str(path)] = [hashing.size, hashing.digest.hexdigest()]

    def makedirs(self, path, exist_ok=False) -> None:
        self.write(path, lambda: self.inner.makedirs(path, exist_ok=exist_ok))

    def write(self, path, attempt, state=None) -> WriteFailure | None:
        """attempt() writes `path` (with torch.save of `state`, if given, for the byte count),
        unless an earlier write failed; returns the failure, if any."""
        error = None
        if self.failure is None:
            try:
                attempt()
                self.bytes += os.path.getsize(path) if state is not None else 0
                return None
            # torch.save to a path reports a full disk as a RuntimeError, without the OS error
            except (OSError, RuntimeError) as e:
                error = e
        size = _saved_size(state) if state is not None else 0
        self.bytes += size
        if error is not None:
            self.failure = write_failure(error, Path(path), size)
        return self.failure


@contextlib.contextmanager
def recorded_writes(engine) -> Iterator[RecordedWrites]:
    """Route the engine's checkpoint writes through a RecordedWrites for the block. Rank 0 also
    copies DeepSpeed's recovery scripts, with shutil rather than the checkpoint engine."""
    writes = RecordedWrites(engine.checkpoint_engine)
    copy_scripts = engine._copy_recovery_script
    engine.checkpoint_engine = writes
    engine._copy_recovery_script = lambda save_path: writes.write(save_path, lambda: copy_scripts(save_path))
    try:
        yield writes
    finally:
        engine.checkpoint_engine = writes.inner
        del engine._copy_recovery_script  # the class's method again


def write_failure(error: Exception, path: Path, needed: int) -> WriteFailure:
    if isinstance(error, OSError) and error.strerror:
        return WriteFailure(str(path), error.strerror, error.errno in (errno.ENOSPC, errno.EDQUOT))
    # torch's writer lost the OS error: less room left than the file needs is a full disk
    if shutil.disk_usage(path.parent).free < needed:
        return WriteFailure(str(path), os.strerror(errno.ENOSPC), True)
    return WriteFailure(str(path), " ".join(str(error).split()), False)


class _HashingFile:
    """A file being written, hashing (xxh3-64) and counting what goes through it."""

    def __init__(self, f):
        self.f, self.digest, self.size = f, xxhash.xxh3_64(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _ByteCounter:
    """A file object that only counts what is written to it."""

    def __init__(self):
        self.count = 0

    def write(self, data) -> int:
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _saved_size(state) -> int:
    """The bytes torch.save writes for `state` (serialized without being stored)."""
    counter = _ByteCounter()
    torch.save(state, counter)
    return counter.count
