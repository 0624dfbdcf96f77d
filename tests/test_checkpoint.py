"""Checkpoint directory logic: which checkpoint a run resumes from, what retention deletes, and
the RNG state round trip. (Real DeepSpeed checkpoints, kill -9 and an interrupted write are
exercised end to end in test_train_preemption.py.)"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from common.fileio import atomic_write
from pretrain import checkpoint


def make(ckpt_dir, step, complete=True):
    tag_dir = ckpt_dir / checkpoint.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    if complete:
        (tag_dir / checkpoint.MARKER).write_text(json.dumps({"step": step}))
    return tag_dir


def test_resume_takes_the_newest_complete_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "run" / "ckpt"
    assert checkpoint.find_checkpoint("auto", ckpt) is None  # fresh run
    make(ckpt, 4)
    eight = make(ckpt, 8)
    twelve = make(ckpt, 12, complete=False)  # its write was interrupted
    assert checkpoint.find_checkpoint("auto", ckpt) == eight
    assert f"warning: skipping incomplete checkpoint {twelve}" in capsys.readouterr().err
    assert checkpoint.find_checkpoint("never", ckpt) is None
    # an explicit path: a run directory, its ckpt/ directory, or one complete checkpoint
    assert checkpoint.find_checkpoint(str(tmp_path / "run"), tmp_path / "elsewhere") == eight
    assert checkpoint.find_checkpoint(str(ckpt), tmp_path / "elsewhere") == eight
    assert checkpoint.find_checkpoint(str(ckpt / "step_00000004"), ckpt) == ckpt / "step_00000004"
    with pytest.raises(ValueError, match="checkpoint is incomplete"):
        checkpoint.find_checkpoint(str(twelve), ckpt)
    with pytest.raises(ValueError, match="no complete checkpoint found"):
        checkpoint.find_checkpoint(str(tmp_path), ckpt)


def test_tags_sort_by_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (900, 80, 1000, 7):
        make(ckpt, step)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == [
        "step_00000007", "step_00000080", "step_00000900", "step_00001000"]
    assert checkpoint.newest_complete(ckpt).name == "step_00001000"


def test_retention_keeps_the_newest_complete_ones(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (4, 8, 12):
        make(ckpt, step)
    make(ckpt, 6, complete=False)   # left by a crash: older than the newest complete one
    make(ckpt, 16, complete=False)  # newer: could be a write in progress, left alone
    checkpoint._prune(ckpt, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == [
        "step_00000008", "step_00000012", "step_00000016"]


def test_atomic_write_never_shows_a_partial_file(tmp_path):
    target = tmp_path / "latest"
    target.write_text("step_00000004")

    def failing(tmp):
        tmp.write_text("step_000")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(target, failing)
    assert target.read_text() == "step_00000004"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no temporary file left over
    atomic_write(target, lambda tmp: tmp.write_text("step_00000008"))
    assert target.read_text() == "step_00000008"


def test_rng_states_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = checkpoint.capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    checkpoint.restore_rng(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
