"""Shared runs of the trainer tests: a tiny char-level dataset, the base test config, launch
helpers and the exact-resume matrix. Several test files reuse the same runs (TensorBoard
contents, export, preemption references), so they are computed once per pytest process and
cached here.

Run as a script under torchrun it is the matrix worker: every (family, ZeRO stage) cell trains
an uninterrupted run, then a fresh engine resumes it from its middle checkpoint, all inside the
same two processes (each run builds its own model, engine and loaders), which saves two
interpreter and DeepSpeed start-ups per run."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Callable, Iterator

import yaml

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
FAMILIES = {"gpt": "gpt-tiny", "nrgpt": "nrgpt-tiny", "ebt": "ebt-tiny"}
STAGES = (1, 2, 3)
EXTRA_CELLS = {
    "ebt_s2": ("ebt-s2-tiny", 2, ["optimizer.decay=all", "optimizer.weight_decay=0.01"]),
    "nrgpt_released": ("nrgpt-tiny", 2, ["model.overrides.dropout=0.1",
                                         "model.overrides.dropout_placement=attention", "optimizer.decay=nanogpt"]),
    "gpt_bf16": ("gpt-tiny", 2, ["train.precision=bf16", "zero.overlap_comm=true",
                                 "zero.reduce_bucket_size=5000", "zero.allgather_bucket_size=5000"]),
    "ebt_autocast": ("ebt-tiny", 2, ["train.precision=bf16-autocast"]),
}
"""Beyond families x stages, under ZeRO-2 (flavor, stage, overrides): EBT's S2 recipe (random
step counts and step sizes, Langevin noise also at eval, a replay buffer that differs per rank,
decay on all but alpha), NRGPT with the released code's dropout placement and nanoGPT's
decay set, the OpenWebText configs' ZeRO-2 (bf16 with fp32 gradient accumulation,
reductions overlapped with backward in several buckets), and EBT under autocast (fp32 weights,
bf16 matmuls, its second-order descent inside torch.autocast)."""
N_STEPS = 12
"""Steps of every test run; checkpoints every CKPT_INTERVAL steps."""
CKPT_INTERVAL = 4
RESUME_STEP = 4
"""The resumed matrix runs restart from this checkpoint."""

BASE_CONFIG = {
    "seed": 7,
    "model": {"flavor": "gpt-tiny"},
    # 2 sequences x 2 ranks x 2 accumulation steps = the global batch of 8
    "data": {"seq_len": 32, "micro_batch_size": 2, "num_workers": 1},
    "optimizer": {"lr": 3e-3},
    "schedule": {"kind": "cosine", "warmup_steps": 2, "min_lr": 3e-4},
    "train": {"max_steps": N_STEPS, "global_batch_size": 8, "log_interval": 1},
    "zero": {"stage": 2},
    "checkpoint": {"interval": CKPT_INTERVAL, "keep": 5},
    "eval": {"interval": 0, "batches": 2, "think_steps": 3, "sample_tokens": 8, "dynamics": True},
}


WORKSPACE_ENV = "TRAINER_TESTS_WORKSPACE"


@cache
def workspace() -> Path:
    """A temporary directory for the whole pytest process (dataset, configs, runs), removed at
    exit; child processes find it through an environment variable."""
    if WORKSPACE_ENV not in os.environ:
        path = tempfile.mkdtemp(prefix="trainer-tests-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ[WORKSPACE_ENV] = path
    return Path(os.environ[WORKSPACE_ENV])


CHAR_DATASET = {"seq_len": 32, "val_fraction": 0.05, "tokenizer": "char", "max_docs": 80, "num_proc": 1}
"""`prepare` settings of the character-level Shakespeare the base config trains on."""


@cache
def char_dataset() -> Path:
    """Character-level Shakespeare (first 80 documents), windows of 33 characters."""
    from data_pipeline.prepare import prepare

    path = workspace() / "shakespeare-char-32"
    prepare("shakespeare", str(path), **CHAR_DATASET)
    return path


def base_config_file() -> Path:
    """The test config (written once); runs differ by command-line overrides."""
    path = workspace() / "base.yaml"
    if not path.exists():
        config = {**BASE_CONFIG, "output_root": str(workspace() / "runs"),
                  "data": {**BASE_CONFIG["data"], "path": str(char_dataset())}}
        path.write_text(yaml.safe_dump(config))
    return path


def run_overrides(family: str, stage: int) -> list[str]:
    if family in FAMILIES:
        return [f"model.flavor={FAMILIES[family]}", f"zero.stage={stage}"]
    flavor, _, extra = EXTRA_CELLS[family]
    return [f"model.flavor={flavor}", f"zero.stage={stage}", *extra]


def terminal_sigint() -> None:
    """preexec_fn for commands a test stops with Ctrl-C: SIGINT at its default, as a terminal's
    Ctrl-C finds it. A shell without job control starts background jobs (a suite run as one)
    with SIGINT ignored, and Python would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def lower_priority() -> None:
    """preexec_fn for training processes that a test interrupts: niced, so that on a busy
    machine the test process gets the CPU promptly when it is time to send the signal."""
    os.nice(10)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun starts each worker in a session of its own, so
    killing torchrun's process group would leave the trainers running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def wait_for(done: Callable[[], object], what: str, proc: subprocess.Popen, poll_s: float = 0.05,
             timeout: float = 240) -> None:
    """Until done() is true, while proc runs; `what` names it in the failure, with the end of
    proc's stderr where it is a pipe."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"{what}: exit code {proc.returncode} {(proc.communicate()[1] or '')[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(poll_s)


def remove_leaked_shared_memory() -> None:
    """Remove the shared memory that streaming's datasets of killed test runs leave in /dev/shm:
    the segments of every prefix whose `locals` record names a directory of this workspace.
    (streaming's own clean_stale_shared_memory would remove other jobs' live segments too.)"""
    shm = Path("/dev/shm")
    for record in shm.glob("*_locals"):
        try:
            mine = str(workspace()).encode() in record.read_bytes()
        except OSError:
            continue
        if mine:
            for segment in shm.glob(record.name.removesuffix("locals") + "*"):
                segment.unlink(missing_ok=True)


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return {**env, **extra}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(module_args: list[str], nproc: int = 2) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", *module_args]


def train_command(overrides: list[str], nproc: int = 2) -> list[str]:
    args = ["-m", "pretrain.train", "--config", str(base_config_file()), *overrides]
    return torchrun_command(args, nproc) if nproc > 1 else [PYTHON, *args]


@contextlib.contextmanager
def world_of_one_here() -> Iterator[None]:
    """The block runs in this process as a world of one: a surrounding launch's variables are set
    aside, and afterwards the process group (if one was made) is destroyed and the variables are
    as they were, so later child processes do not inherit the ones a trainer filled in."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    saved = {name: os.environ.pop(name) for name in LAUNCH_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # DeepSpeed keeps its clone of the world group past destroy_process_group; the next run
        # in this process would broadcast over the destroyed one.
        groups._WORLD_GROUP = None
        for name in LAUNCH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(saved)


def command_here(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` run in this process, returned as its subprocess would be (exit
    code, stdout, stderr): the same command line, without an interpreter and DeepSpeed start-up
    per run (most of a tiny run's time), as a world of one (`world_of_one_here`)."""
    import importlib
    import io

    package_commands = ("pretrain.scaling", "pretrain.models")  # python -m runs their __main__
    main = importlib.import_module(f"{module}.__main__" if module in package_commands else module).main
    out, err = io.StringIO(), io.StringIO()
    with world_of_one_here(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def train_here(overrides: list[str], config: Path | None = None) -> subprocess.CompletedProcess:
    """The trainer's command line on the base test config (or `config`) in this process."""
    return command_here("pretrain.train", ["--config", str(config or base_config_file()), *overrides])


def run_dir(name: str) -> Path:
    return workspace() / "runs" / name


def scalars(name: str, tag: str) -> dict[int, float]:
    """step -> value of a run's TensorBoard scalar (the last value written for a step)."""
    from pretrain.scaling.experiments.common import scalar_curve

    return dict(scalar_curve(run_dir(name), tag))


def matrix_cells() -> list[tuple[str, int]]:
    return [(family, stage) for family in FAMILIES for stage in STAGES] + \
        [(name, stage) for name, (_, stage, _) in EXTRA_CELLS.items()]


def reference_name(family: str, stage: int) -> str:
    return f"{family}-z{stage}"


@cache
def resume_matrix() -> subprocess.CompletedProcess:
    """Train every cell uninterrupted and resumed (one torchrun launch); see the module doc."""
    base_config_file()
    result = subprocess.run(torchrun_command([str(Path(__file__).resolve())]),
                            env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"resume matrix failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def _matrix_worker() -> None:
    sys.path.insert(0, str(REPO))
    from pretrain.config import load_config
    from pretrain.config.validation import validate
    from pretrain.training.trainer import run

    config_file = base_config_file()
    for family, stage in matrix_cells():
        name = reference_name(family, stage)
        overrides = run_overrides(family, stage)
        for run_name, extra in ((name, []),
                                (name + "-resumed", [f"resume={run_dir(name)}/ckpt/step_{RESUME_STEP:08d}"])):
            cfg = load_config(config_file, [*overrides, f"run_name={run_name}", *extra])
            validate(cfg, int(os.environ["WORLD_SIZE"]), has_gpu=False)
            if run(cfg) != 0:
                raise SystemExit(f"{run_name} did not finish")
    print(json.dumps({"cells": matrix_cells()}))


if __name__ == "__main__":
    _matrix_worker()
