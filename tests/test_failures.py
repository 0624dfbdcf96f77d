"""Failures end in one clear line and lose no work: damaged checkpoints are detected and skipped,
a resume onto other data is refused (or allowed deliberately), Ctrl-C saves, resume=restart
moves a run aside, and bad launches under launch/torchrun.sh fail in one line with the
trainer's exit code. Real runs of the trainer: its command line in this process, one rank, unless
a signal or the launcher is the point."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import trainer_runs as runs
from test_launch_scripts import TORCHRUN_SIGNALS
from data_pipeline.prepare import default_num_proc
from pretrain.training import checkpoint
from pretrain.training.checkpoint import layout
from pretrain.training.runlock import lock_file
from pretrain.training.stopping import EXIT_PREEMPTED

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SOURCE_STEPS = 8
"""The source run's length: complete checkpoints at steps 4 and 8."""
ONE_PROCESS = ["model.flavor=gpt-tiny", "zero.stage=1", f"train.max_steps={SOURCE_STEPS}"]


def train(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """A one-process run of the trainer's command line (in this process: see `train_here`)."""
    return runs.train_here([*ONE_PROCESS, f"output_root={tmp_path}", f"run_name={name}", *extra])


def one_error_line(stderr: str) -> str:
    """The stderr of a failed command: no traceback, and its last line is the one error line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), stderr[-3000:]
    assert sum(line.startswith("error: ") for line in lines) == 1, stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A finished one-process run with complete checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("failures")
    result = train(root, "source")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "source"


def copy_run(source_run: Path, tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / name
    shutil.copytree(source_run, run_dir)
    return run_dir


def tag(run_dir: Path, step: int) -> Path:
    return run_dir / "ckpt" / checkpoint.tag_for(step)


def truncate_optimizer_shard(tag_dir: Path) -> Path:
    shard = next(tag_dir.glob("zero_pp_rank_0_*optim_states.pt"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    return shard


def garble_marker(tag_dir: Path) -> Path:
    (tag_dir / checkpoint.MARKER).write_text("{garbage")
    return tag_dir / checkpoint.MARKER


def empty_model_states(tag_dir: Path) -> Path:
    path = tag_dir / "mp_rank_00_model_states.pt"
    path.write_bytes(b"")
    return path


def flip_a_byte(tag_dir: Path) -> Path:
    """Damage that keeps the size: only the checksum can tell."""
    shard = next(tag_dir.glob("zero_pp_rank_0_*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_the_marker_records_every_file_with_size_and_checksum(source_run):
    marker = checkpoint.Marker.read(tag(source_run, SOURCE_STEPS))
    files = layout.checkpoint_files(tag(source_run, SOURCE_STEPS))
    assert sorted(marker.files) == files and "mp_rank_00_model_states.pt" in files
    assert all(size == (tag(source_run, SOURCE_STEPS) / rel).stat().st_size for rel, (size, _) in marker.files.items())
    assert marker.data["tokenizer"] == "char" and marker.data["seq_len"] == 32
    assert layout.damaged_files(tag(source_run, SOURCE_STEPS), marker) == []


@pytest.mark.parametrize("damage", [truncate_optimizer_shard, garble_marker, empty_model_states, flip_a_byte])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(source_run, tmp_path, damage):
    run_dir = copy_run(source_run, tmp_path, "damaged")
    (run_dir / "summary.json").unlink()
    damaged = damage(tag(run_dir, SOURCE_STEPS))
    result = train(tmp_path, "damaged")
    assert result.returncode == 0, result.stderr[-3000:]
    warning = next(line for line in result.stderr.splitlines() if "damaged checkpoint skipped" in line)
    assert str(damaged) in warning and warning.endswith(f"resuming from {tag(run_dir, 4)}")
    assert "resuming at step 4" in result.stdout and "Traceback" not in result.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == SOURCE_STEPS


def test_every_checkpoint_damaged_is_one_line_naming_each_file(source_run, tmp_path):
    run_dir = copy_run(source_run, tmp_path, "ruined")
    shard = truncate_optimizer_shard(tag(run_dir, SOURCE_STEPS))
    states = empty_model_states(tag(run_dir, 4))
    result = train(tmp_path, "ruined", f"train.max_steps={SOURCE_STEPS + 4}")
    assert result.returncode == 1
    line = one_error_line(result.stderr)
    assert "every one is damaged" in line and str(shard) in line and str(states) in line
    assert "1000 bytes" in line


def test_an_explicit_damaged_checkpoint_is_refused(source_run, tmp_path):
    run_dir = copy_run(source_run, tmp_path, "explicit")
    flip_a_byte(tag(run_dir, 4))
    result = train(tmp_path, "fresh", f"resume={tag(run_dir, 4)}")
    assert result.returncode == 1
    assert "checksum mismatch" in one_error_line(result.stderr)
    assert not (tmp_path / "fresh").exists()  # nothing created


def test_resume_onto_other_data_is_refused_unless_allowed(source_run, tmp_path):
    from data_pipeline.prepare import prepare

    other = tmp_path / "other-data"  # same tokenizer and seq_len, other documents
    prepare("shakespeare", str(other), seq_len=32, val_fraction=0.05, tokenizer="char", max_docs=60, num_proc=1)
    run_dir = copy_run(source_run, tmp_path, "moved")
    longer = f"train.max_steps={SOURCE_STEPS + 4}"
    refused = train(tmp_path, "moved", longer, f"data.path={other}")
    assert refused.returncode == 2
    line = one_error_line(refused.stderr)
    assert "not the data checkpoint" in line and "fingerprint" in line and "data.allow_change=true" in line

    allowed = train(tmp_path, "moved", longer, f"data.path={other}", "data.allow_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "data.allow_change: continuing on" in allowed.stdout
    assert "the loader starts at its beginning" in allowed.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == SOURCE_STEPS + 4


def test_resume_onto_another_vocabulary_is_refused_even_when_allowed(source_run, tmp_path):
    from data_pipeline.prepare import prepare

    bpe = tmp_path / "bpe-data"
    prepare("shakespeare", str(bpe), seq_len=32, val_fraction=0.2, tokenizer="gpt2", max_docs=40, num_proc=1)
    copy_run(source_run, tmp_path, "vocab")
    result = train(tmp_path, "vocab", f"train.max_steps={SOURCE_STEPS + 4}", f"data.path={bpe}",
                   "data.allow_change=true")
    assert result.returncode == 2
    assert "does not fit the model" in one_error_line(result.stderr)


def test_resume_restart_moves_the_run_aside_and_starts_fresh(source_run, tmp_path):
    run_dir = copy_run(source_run, tmp_path, "again")
    never = train(tmp_path, "again", "resume=never")
    assert never.returncode == 2 and "resume=restart moves it aside" in one_error_line(never.stderr)
    result = train(tmp_path, "again", "resume=restart", "train.max_steps=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fresh start" in result.stdout
    (aside,) = tmp_path.glob("again.replaced-*")
    assert checkpoint.is_complete(tag(aside, SOURCE_STEPS))  # nothing of the old run deleted
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("launcher", ["python", "torchrun.sh"])
def test_ctrl_c_saves_a_checkpoint_and_exits_with_the_requeue_code(tmp_path, launcher):
    overrides = [*ONE_PROCESS[:2], "train.max_steps=100000", "checkpoint.interval=4",
                 f"output_root={tmp_path}", "run_name=interrupted"]
    if launcher == "python":
        command, env = runs.train_command(overrides, nproc=1), runs.child_env()
    else:
        command = ["bash", "launch/torchrun.sh", str(runs.base_config_file()), *overrides]
        env = runs.child_env(NPROC_PER_NODE="2", PYTHON=runs.PYTHON, MASTER_PORT=str(runs.free_port()))
    # a session of its own: Ctrl-C signals the terminal's whole foreground process group
    proc = subprocess.Popen(command, cwd=runs.REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        marker = tag(tmp_path / "interrupted", 4) / checkpoint.MARKER
        runs.wait_for(marker.exists, f"{marker} written", proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "on SIGINT: checkpoint saved" in out
    stopped = int(next(line for line in out.splitlines() if line.startswith("stopping at step")).split()[3])
    assert checkpoint.is_complete(tag(tmp_path / "interrupted", stopped))


def corpus(directory: Path, files: int = 30, mib_per_file: int = 1) -> str:
    """A text source that takes the data preparation tens of seconds (on 2 cores): `files`
    documents of a mebibyte of made-up words each."""
    directory.mkdir()
    words = [f"w{(i * 7919) % 5003:x}" for i in range(5003)]
    text = " ".join(words[(i * i) % len(words)] for i in range(mib_per_file * 2**20 // 5))
    for i in range(files):
        (directory / f"{i:03d}.txt").write_text(f"document {i}: {text}")
    return f"text:{directory}"


@pytest.mark.parametrize("launcher, signum, code", [("python", signal.SIGTERM, EXIT_PREEMPTED),
                                                    ("torchrun.sh", signal.SIGINT, 130)])
def test_a_stop_signal_during_setup_stops_it_at_once(tmp_path, launcher, signum, code):
    """Preparing the data is part of setup and can take hours: a stop signal then ends the run
    within seconds (nothing is trained, so there is nothing to save), leaving nothing behind.
    The signal goes to the whole process group, as a scheduler's or a terminal's does: one rank
    and its tokenizer processes (python), or torchrun, which forwards it to the ranks."""
    dataset = tmp_path / "prepared"
    overrides = [*ONE_PROCESS[:2], f"output_root={tmp_path}", "run_name=stopped", f"data.path={dataset}",
                 f"data.source={corpus(tmp_path / 'corpus')}", "data.val_fraction=0.1"]
    if launcher == "python":
        command, env, ranks = runs.train_command(overrides, nproc=1), runs.child_env(), 1
    else:
        command = ["bash", "launch/torchrun.sh", str(runs.base_config_file()), *overrides]
        env = runs.child_env(NPROC_PER_NODE="2", PYTHON=runs.PYTHON, MASTER_PORT=str(runs.free_port()))
        ranks = 2
    proc = subprocess.Popen(command, cwd=runs.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=runs.terminal_sigint)
    try:
        runs.wait_for(lambda: any(tmp_path.glob(".prepared.incomplete-*")), "the preparation begun", proc)
        # and its tokenizer processes run (forked by rank 0: the same command line)
        runs.wait_for(lambda: importing_torch(proc, "pretrain.train") >= ranks + (default_num_proc() > 1),
                      "the tokenizer processes started", proc)
        signalled = time.monotonic()
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=240)
        stopped_within = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-3000:]
    line = one_error_line(err)
    if signum == signal.SIGINT:
        assert line == "error: interrupted"
    else:
        assert line.startswith("error: stopped by SIGTERM while setting up, before the first step")
    assert stopped_within < 10, f"took {stopped_within:.0f} s to stop"  # preparing takes tens
    # nor a run: only the run's lock file, which stays by design (pretrain.training.runlock)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock_file(tmp_path / "stopped").name, "corpus",
                                                          "prepared.lock"]


def test_a_second_ctrl_c_aborts_but_the_same_keypress_twice_does_not(monkeypatch):
    from pretrain.training.stopping import REPEAT_SIGINT_S, Aborted, StopSignals

    stops = StopSignals.__new__(StopSignals)  # only the signal state; no handler installed
    stops.signum, stops.time, stops.rank, stops.looping = 0, 0.0, 0, True
    stops.pid = os.getpid()
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stops._on_signal(signal.SIGINT, None)
    assert stops.signum == signal.SIGINT
    clock[0] += REPEAT_SIGINT_S / 4  # torchrun forwarding the same Ctrl-C
    stops._on_signal(signal.SIGINT, None)
    clock[0] += REPEAT_SIGINT_S
    with pytest.raises(Aborted):
        stops._on_signal(signal.SIGINT, None)


def test_before_the_first_step_a_stop_signal_raises_once():
    from pretrain.training.stopping import StopSignals, StoppedInSetup

    stops = StopSignals.__new__(StopSignals)
    stops.signum, stops.time, stops.rank, stops.looping = 0, 0.0, 0, False
    stops.pid = os.getpid()
    with pytest.raises(StoppedInSetup) as stopped:
        stops._on_signal(signal.SIGTERM, None)
    assert stopped.value.signum == signal.SIGTERM
    stops._on_signal(signal.SIGINT, None)  # a second signal while setup unwinds: ignored
    stops.signum = 0
    with pytest.raises(KeyboardInterrupt):
        stops._on_signal(signal.SIGINT, None)
    stops.signum, stops.pid = 0, os.getpid() + 1  # as in a process forked from the trainer
    stops._on_signal(signal.SIGTERM, None)
    assert stops.signum == 0  # the stop is the trainer's, not the forked process's


def importing_torch(proc: subprocess.Popen, module: str) -> int:
    """How many of proc and its descendants run `python -m MODULE` (not its --check) and have
    begun importing torch (its library is mapped): from then on the command needs seconds more
    before its main() runs."""
    count = 0
    for pid in runs.process_tree(proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            started = module.encode() == argv[argv.index(b"-m") + 1] and b"--check" not in argv
            count += started and "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except (OSError, ValueError):  # not a python -m command, or gone meanwhile
            continue
    return count


@pytest.mark.parametrize("launch", ["sample", "prepare", "torchrun.sh"])
def test_ctrl_c_while_a_command_is_still_starting_is_one_line(tmp_path, launch):
    """Ctrl-C while the command (under torchrun.sh: both trainer ranks) still imports torch, before
    its main() could catch it: the one line and 130, no traceback (and none from torchrun)."""
    env = runs.child_env()
    if launch == "torchrun.sh":
        command = ["bash", "launch/torchrun.sh", str(runs.base_config_file()), f"output_root={tmp_path}"]
        env = runs.child_env(NPROC_PER_NODE="2", PYTHON=runs.PYTHON, MASTER_PORT=str(runs.free_port()))
        module, processes = "pretrain.train", 2
    else:  # had the Ctrl-C come too late, these would end otherwise (2: no such run; 0: help)
        module, processes = {"sample": "pretrain.sample", "prepare": "data_pipeline.prepare"}[launch], 1
        command = [runs.PYTHON, "-m", module, *(["no-such-run", "--prompt", "x"] if launch == "sample" else ["--help"])]
    # a session of its own: a terminal's Ctrl-C signals its process group
    proc = subprocess.Popen(command, cwd=runs.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=runs.terminal_sigint)
    try:
        runs.wait_for(lambda: importing_torch(proc, module) >= processes, f"{module} started", proc, poll_s=0.01)
        os.killpg(proc.pid, signal.SIGINT)  # torchrun forwards it to the ranks (sessions of their own)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert one_error_line(err) == "error: interrupted"


def test_data_overwrite_rebuilds_a_dataset_prepared_for_another_seq_len(tmp_path):
    """The launch checks must not refuse a dataset that data.overwrite is about to rebuild."""
    data = tmp_path / "data"
    shutil.copytree(runs.char_dataset(), data)
    asked = [*ONE_PROCESS[:2], "train.max_steps=1", f"output_root={tmp_path}", f"data.path={data}",
             "data.source=shakespeare", "data.tokenizer=char", "data.val_fraction=0.05", "data.seq_len=16"]
    refused = runs.train_here([*asked, "run_name=refused"])
    assert refused.returncode == 2
    assert "the dataset at" in one_error_line(refused.stderr) and "seq_len=32" in refused.stderr
    rebuilt = runs.train_here([*asked, "run_name=rebuilt", "data.overwrite=true"])
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert json.loads((data / "manifest.json").read_text())["seq_len"] == 16


def test_a_bad_launch_under_torchrun_is_one_line_with_the_trainers_code(tmp_path):
    env = runs.child_env(NPROC_PER_NODE="2", PYTHON=runs.PYTHON, MASTER_PORT=str(runs.free_port()))
    bad_config = subprocess.run(["bash", "launch/torchrun.sh", str(runs.base_config_file()),
                                 f"output_root={tmp_path}", "train.global_batch_size=3"],
                                cwd=runs.REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad_config.returncode == 2
    assert "train.global_batch_size=3: 2 processes cannot share it evenly" in one_error_line(bad_config.stderr)
    assert "ChildFailedError" not in bad_config.stderr and "torch.distributed" not in bad_config.stderr


def test_an_error_inside_a_torchrun_launch_is_the_last_line(source_run, tmp_path):
    """Damage only a checksum sees: the one-process check (sizes only) passes, the ranks find it."""
    run_dir = copy_run(source_run, tmp_path, "inside")
    flip_a_byte(tag(run_dir, 4))
    env = runs.child_env(NPROC_PER_NODE="2", PYTHON=runs.PYTHON, MASTER_PORT=str(runs.free_port()))
    result = subprocess.run(["bash", "launch/torchrun.sh", str(runs.base_config_file()), *ONE_PROCESS[:2],
                             f"output_root={tmp_path}", "run_name=fresh", f"resume={tag(run_dir, 4)}"],
                            cwd=runs.REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "checksum mismatch" in one_error_line(result.stderr)
    assert "ChildFailedError" not in result.stderr


def test_one_rank_failing_alone_ends_the_launch_at_once_with_its_line(tmp_path):
    """An error only rank 1 meets (tests/failing_rank_worker.py), while rank 0 waits for it inside
    DeepSpeed's engine set-up, in C++, where no signal handler runs: the launcher stops rank 0
    within seconds (torchrun alone would give it 30), prints rank 1's line last (rank 0, which
    prints the errors, never saw it) and exits with rank 1's code."""
    failed_at = tmp_path / "failed_at"
    command = [runs.PYTHON, "-m", "pretrain.torchrun", "--nproc_per_node=2", "--standalone",
               TORCHRUN_SIGNALS, "--shutdown-timeout=300", str(runs.REPO / "tests/failing_rank_worker.py"),
               "1", str(failed_at), "--config", str(runs.base_config_file()), *ONE_PROCESS[:2],
               f"output_root={tmp_path}"]
    result = subprocess.run(command, cwd=runs.REPO, env=runs.child_env(), capture_output=True, text=True,
                            timeout=300)
    ended_within = time.time() - float(failed_at.read_text())
    assert result.returncode == 2, result.stderr[-3000:]
    assert one_error_line(result.stderr) == "error: rank 1 fails on purpose"
    assert ended_within < 15, f"the launch ended {ended_within:.0f} s after rank 1 failed"


def test_ranks_ending_after_a_stop_signal_are_not_cut_short_by_the_failure_grace(tmp_path):
    """After a stop signal every rank exits with 75, rank 0 last: it completes the checkpoint and
    prunes the old ones after the others have gone. That is no failure: the launcher waits for
    rank 0 (here twice the failure grace) and exits with 75, instead of killing it 5 s after the
    first 75."""
    from pretrain.torchrun import FAILED_PEER_GRACE_S

    done = tmp_path / "done"
    command = [runs.PYTHON, "-m", "pretrain.torchrun", "--nproc_per_node=2", "--standalone", TORCHRUN_SIGNALS,
               str(runs.REPO / "tests/preempted_rank_worker.py"), str(2 * FAILED_PEER_GRACE_S), str(done)]
    result = subprocess.run(command, cwd=runs.REPO, env=runs.child_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 75, result.stderr[-3000:]
    assert done.read_text() == "pruned"
    assert "error:" not in result.stderr, result.stderr[-3000:]


UNSHARE = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
"""A mount namespace of its own (with a user namespace where the tests do not run as root)."""


@pytest.fixture(scope="session")
def mounting(tmp_path_factory) -> None:
    """Skips where no tmpfs can be mounted in a mount namespace of one's own."""
    probe = tmp_path_factory.mktemp("mount-probe")
    tried = subprocess.run([*UNSHARE, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(probe)],
                           capture_output=True, text=True)
    if tried.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {' '.join(tried.stderr.split())}")


def in_small_filesystem(directory: Path, options: str, command: list[str], copy_to: Path | None = None,
                        timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `command` with a tmpfs mounted (mount `options`, e.g. size=100k) on `directory`, in a
    mount namespace of its own: a real small file system, gone with the command, whatever happens
    to the test. What the command left there is copied to `copy_to` first."""
    script = ('mount -t tmpfs -o "$1" tmpfs "$2" || exit 99; small=$2 copy_to=$3; shift 3; "$@"; code=$?; '
              '[ -z "$copy_to" ] || cp -a "$small/." "$copy_to"; exit $code')
    directory.mkdir(exist_ok=True)
    return subprocess.run([*UNSHARE, "sh", "-c", script, "sh", options, str(directory), str(copy_to or ""),
                           *command], cwd=runs.REPO, env=runs.child_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_an_output_root_that_cannot_be_created_is_refused_before_any_work():
    """/proc is writable for root by its permission bits, but nothing can be created in it."""
    for command in (["--check"], []):  # the launcher's check, and a run on its own
        result = runs.train_here([*command, *ONE_PROCESS, "output_root=/proc/nope"])
        assert result.returncode == 2, result.stderr[-3000:]
        assert one_error_line(result.stderr) == (
            "error: output_root: cannot create directories in /proc (No such file or directory), so the run "
            "directory /proc/nope/base cannot be made there; choose another output_root")


def test_an_output_root_on_a_full_file_system_is_refused_by_the_check(tmp_path, mounting):
    """A file system with no room for one more directory: its permission bits say writable."""
    small = tmp_path / "small"
    result = in_small_filesystem(small, "size=64k,nr_inodes=1", [
        runs.PYTHON, "-m", "pretrain.train", "--check", "--config", str(runs.base_config_file()),
        f"output_root={small}/runs", "run_name=full"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert one_error_line(result.stderr) == (
        f"error: output_root: cannot create directories in {small} (No space left on device), so the run "
        f"directory {small}/runs/full cannot be made there; choose another output_root")


def test_a_full_disk_under_tensorboard_leaves_the_run_going_with_one_warning(tmp_path, mounting):
    """The run's tb/ on a file system without room for its event file: TensorBoard goes off with
    one warning naming the file system, and the run trains on to its end (its checkpoints and
    summary.json are elsewhere here) instead of failing on rank 0 alone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = in_small_filesystem(run_dir / "tb", "size=4k", [
        runs.PYTHON, "-m", "pretrain.train", "--config", str(runs.base_config_file()), *ONE_PROCESS,
        f"output_root={tmp_path}", "run_name=run"])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "TensorBoard" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: TensorBoard logs not written to {run_dir}/tb (No space left on device: out of space on "
        f"{run_dir}/tb, the file system of {run_dir}/tb, ") and warnings[0].endswith(
        " free); training goes on without them until the run is restarted"), warnings
    marker, damage = checkpoint.check_intact(tag(run_dir, SOURCE_STEPS))
    assert damage == [] and marker.step == SOURCE_STEPS
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == SOURCE_STEPS


def test_a_summary_that_cannot_be_written_is_one_line_after_the_final_checkpoint(tmp_path):
    """summary.json is written last, by rank 0: a failure there (here a directory in its place;
    a full disk takes the same way) is one line saying the final checkpoint is saved and that a
    rerun writes the summary, which it does."""
    run_dir = tmp_path / "run"
    (run_dir / "summary.json").mkdir(parents=True)
    result = train(tmp_path, "run")
    assert result.returncode == 1
    assert one_error_line(result.stderr) == (
        f"error: {run_dir}/summary.json not written (Is a directory); the final checkpoint (step {SOURCE_STEPS}) "
        "is saved: make room there, then rerun the same command to write it")
    assert checkpoint.check_intact(tag(run_dir, SOURCE_STEPS))[1] == []
    (run_dir / "summary.json").rmdir()
    rerun = train(tmp_path, "run")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == SOURCE_STEPS


def test_the_output_root_check_leaves_nothing_behind(tmp_path):
    from pretrain.config import RunConfig
    from pretrain.training.preflight import check_output_root

    check_output_root(RunConfig(output_root=str(tmp_path / "a" / "b"), run_name="run"))
    (tmp_path / "run").mkdir()
    check_output_root(RunConfig(output_root=str(tmp_path), run_name="run"))
    assert [p.name for p in tmp_path.iterdir()] == ["run"] and not any((tmp_path / "run").iterdir())


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(source_run, tmp_path, mounting):
    """Two ranks on a file system with room for one checkpoint (sized by the one-process source
    run's, which is about as large) but not two: the second save fails on both ranks alike, in
    one line naming the file system and the space the checkpoint needs; the partial checkpoint is
    removed and the first stays the newest, with `latest` naming it."""
    checkpoint_bytes = sum(p.stat().st_size for p in tag(source_run, 4).iterdir())
    small, left = tmp_path / "small", tmp_path / "left"
    launch = ["bash", "launch/torchrun.sh", str(runs.base_config_file()), *ONE_PROCESS[:2], "train.max_steps=12",
              f"output_root={small}", "run_name=full"]
    left.mkdir()
    result = in_small_filesystem(small, f"size={int(1.5 * checkpoint_bytes) // 1024 + 128}k",
                                 ["env", "NPROC_PER_NODE=2", f"MASTER_PORT={runs.free_port()}", *launch], left)
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert line.startswith(f"error: checkpoint {small}/full/ckpt/step_00000008 not saved: out of space on {small} "
                           f"(the file system of {small}/full/ckpt; No space left on device): the checkpoint needs "), line
    needed = int(line.split("the checkpoint needs ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    assert 0.8 * checkpoint_bytes < needed < 1.3 * checkpoint_bytes, line
    assert "step_00000004 stays the newest checkpoint" in line
    assert "Traceback" not in result.stderr
    run_dir = left / "full"
    assert [p.name for p in checkpoint.list_checkpoints(run_dir / "ckpt")] == ["step_00000004"]
    assert not [p for p in (run_dir / "ckpt").iterdir() if p.name.startswith(".")]  # no temporary files
    assert (run_dir / "ckpt" / checkpoint.LATEST).read_text() == "step_00000004"
    marker, damage = checkpoint.check_intact(tag(run_dir, 4))
    assert damage == [] and marker.step == 4


@pytest.mark.parametrize("message, what", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:40061: Connection reset by peer",
     "lost the connection to {peer}: Connection reset by peer;"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:40061",
     "lost the connection to {peer}: Connection closed by peer;"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation to complete",
     "another process sent nothing for train.collective_timeout=15 s;"),
])
def test_a_lost_peer_is_one_line_naming_it_in_each_of_gloos_forms(message, what):
    """gloo reports a dead peer as a reset, an orderly close or a time-out, depending on what the
    peer's kernel had in flight; each is the line naming the peer (or the time-out), never None."""
    import socket

    from pretrain.training.engine import lost_peer_line

    peer = f"{socket.gethostbyaddr('127.0.0.1')[0]} (127.0.0.1)"
    line = lost_peer_line(RuntimeError(message), 15)
    assert line is not None and what.format(peer=peer) in line, line
    assert lost_peer_line(RuntimeError("CUDA out of memory"), 15) is None


SETUP_AND_GROUP_TIMEOUTS = """
import json, sys, torch, torch.distributed.distributed_c10d as c10d
from pretrain.config import load_config
from pretrain.training.trainer import Trainer
trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]))
trainer.setup()
print(json.dumps([group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                  for group in c10d._world.pg_map]))
trainer.close()
"""
"""The trainer's setup as a run starts (process group, dataset, engine), then the timeout of
each process group then in existence."""


def test_the_collective_timeout_reaches_every_process_group(tmp_path):
    """train.collective_timeout is the world group's (from init_process_group) and that of every
    group made after it: DeepSpeed's clone of the world, over which ZeRO reduces the gradients,
    and its data-parallel groups, which would otherwise wait torch's default (30 minutes on
    gloo, 10 on NCCL) for a node that went silent."""
    result = subprocess.run(
        [runs.PYTHON, "-c", SETUP_AND_GROUP_TIMEOUTS, str(runs.base_config_file()), f"output_root={tmp_path}",
         "run_name=timeouts", "train.collective_timeout=123", "data.num_workers=0"],
        cwd=runs.REPO, env=runs.child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    timeouts = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(timeouts) >= 2 and set(timeouts) == {123.0}, timeouts
