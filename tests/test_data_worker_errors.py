"""Every error in a DataLoader worker ends the run in one line, with its exit code, and leaves
nothing waiting: a shard that fails its checksum (2, bad data), in one process and in two, where
the other rank waits for the failed one in the step's all-reduce; a disk that fills while a worker
decompresses a shard, and a worker killed mid-run (1). Real runs of the trainer's command line
in subprocesses with a time limit: what these guard against is a run that never ends (a process
left waiting at exit for a worker that ignores SIGTERM, or for a shard that never comes)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import trainer_runs as runs
from test_failures import in_small_filesystem, mounting, one_error_line  # noqa: F401 (mounting: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ENDS_WITHIN_S = 90
"""The most a run that fails in its first steps may take, start-up included (a few seconds on an
idle machine); one left waiting never ends."""
RUN = ["model.flavor=gpt-tiny", "zero.stage=1", "data.num_workers=2", "train.max_steps=30", "checkpoint.interval=0"]
"""Each run: tiny, with the loader's default two workers per rank (the base config has one)."""
SHARD_READ_AT_STEP_4 = "shard.00005.mds"
"""A shard of `sharded_dataset` that a one-process run first reads in step 4, and so does rank 1
of a two-process run, but not rank 0, which then waits for rank 1 in the step's all-reduce."""


@pytest.fixture(scope="module")
def sharded_dataset(tmp_path_factory) -> Path:
    """The base config's dataset in 64 KB shards (23), which the ranks do not all read at once."""
    from data_pipeline.prepare import prepare

    path = tmp_path_factory.mktemp("data") / "sharded"
    prepare("shakespeare", str(path), **runs.CHAR_DATASET, shard_size="64kb", progress_bar=False)
    return path


@pytest.fixture(scope="module")
def compressed_dataset(tmp_path_factory) -> Path:
    """The base config's dataset with zstd shards, which streaming decompresses on first use."""
    from data_pipeline.prepare import prepare

    path = tmp_path_factory.mktemp("data") / "compressed"
    prepare("shakespeare", str(path), **runs.CHAR_DATASET, compression="zstd", progress_bar=False)
    return path


def with_a_byte_flipped(dataset: Path, copy: Path, shard: str) -> Path:
    """A copy of `dataset` with a byte of one train shard flipped: its size is kept, its checksum not."""
    shutil.copytree(dataset, copy)
    path = copy / "train" / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return copy


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["-m", "pretrain.train", "--config", str(runs.base_config_file()), *RUN, f"output_root={tmp_path}",
            *extra]


def start(command: list[str], stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=runs.REPO, env=runs.child_env(), stdout=stdout, stderr=subprocess.PIPE,
                            text=True)


def kill_all(proc: subprocess.Popen) -> None:
    """Kill `proc` and every process it started (torchrun's workers, each in a session of its own,
    and their data loader workers)."""
    for pid in runs.process_tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def ended(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """How `proc` ended, which must be within ENDS_WITHIN_S: else the test fails (and `proc` is killed)."""
    try:
        out, err = proc.communicate(timeout=ENDS_WITHIN_S)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        out, err = proc.communicate()
        pytest.fail(f"still running {ENDS_WITHIN_S} s after it started; its stderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def no_worker_traceback(stderr: str) -> None:
    assert "DataLoader worker" not in stderr and "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_corrupted_shard_ends_the_run_in_one_line(sharded_dataset, tmp_path, nproc):
    """A DataLoader worker finds the flipped byte by the shard's checksum: the run ends with the
    worker's own line naming the shard and exit code 2, its workers stopped rather than left
    for the exit, where they kept the process waiting. With two processes (under the launcher)
    rank 1 meets the shard alone while rank 0 waits for it in the all-reduce: rank 0 ends
    with a lost peer, and the line and code are rank 1's."""
    data = with_a_byte_flipped(sharded_dataset, tmp_path / "data", SHARD_READ_AT_STEP_4)
    launcher = [runs.PYTHON] if nproc == 1 else [runs.PYTHON, "-m", "pretrain.torchrun", f"--nproc_per_node={nproc}",
                                                 "--standalone"]
    result = ended(start([*launcher, *train_args(tmp_path, f"data.path={data}")]))
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert line.startswith(f"error: shard {data / 'train' / SHARD_READ_AT_STEP_4} is corrupted: xxh64 "), line
    no_worker_traceback(result.stderr)


def test_a_full_disk_in_a_data_worker_ends_the_run_in_one_line(compressed_dataset, tmp_path, mounting):
    """A compressed dataset on a file system with room for it but not for a decompressed shard:
    a worker's streaming thread that decompresses the shard fails with ENOSPC (streaming itself
    only logs that and then ends the worker's epoch as if it were complete, or waits for ever for
    the shard, as does the other worker). The run ends in one line naming the exception, exit
    code 1. `timeout` kills the run's process group (its workers too) if it outlives
    ENDS_WITHIN_S."""
    small, files = tmp_path / "small", [path for path in compressed_dataset.rglob("*") if path.is_file()]
    room = sum(-(-path.stat().st_size // 4096) * 4096 for path in files) + 64 * 1024  # whole pages, and the directories
    copy = small / "data"
    command = ["timeout", "-s", "KILL", str(ENDS_WITHIN_S), "sh", "-c", 'cp -r "$0" "$1" && shift && exec "$@"',
               str(compressed_dataset), str(copy), runs.PYTHON, *train_args(tmp_path, f"data.path={copy}")]
    result = in_small_filesystem(small, f"size={room}", command, timeout=ENDS_WITHIN_S + 30)
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert re.fullmatch(r"error: data loader worker \d failed: OSError: \[Errno 28\] No space left on device", line), line
    no_worker_traceback(result.stderr)


def data_workers(pid: int) -> list[int]:
    """The DataLoader workers of trainer `pid`: its children that run its own command line (the
    other, multiprocessing's resource tracker, runs one of its own)."""
    command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [child for child in runs.process_tree(pid)[1:]
            if Path(f"/proc/{child}/cmdline").read_bytes() == command_line]


def test_a_data_worker_killed_mid_run_ends_the_run_in_one_line(tmp_path):
    """A worker killed as the kernel's OOM killer would, while the run trains (no checkpoint is
    written: a save that the news interrupts says it was not saved, and why): torch notices it
    from its SIGCHLD handler, wherever the step is at the time, or as its wait for a batch times
    out. The run ends in one line naming the worker, exit code 1."""
    console = tmp_path / "stdout"
    with console.open("w") as stdout:
        proc = start([runs.PYTHON, *train_args(tmp_path, "train.max_steps=100000")], stdout=stdout)
    try:
        runs.wait_for(lambda: "\nstep 1/" in console.read_text(), "the first step", proc)
        worker = data_workers(proc.pid)[0]
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        result = ended(proc)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    assert result.returncode == 1, result.stderr[-3000:]
    # torch names the signal, unless the worker's end reaches it by its wait for a batch timing out
    line = one_error_line(result.stderr)
    assert re.fullmatch(rf"error: data loader worker \(pid {worker}\) died: (killed by signal: Killed|it exited "
                        r"unexpectedly)", line), line
    no_worker_traceback(result.stderr)
    assert time.monotonic() - killed < 30
