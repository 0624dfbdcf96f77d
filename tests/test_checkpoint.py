"""Checkpoint directory logic: which checkpoint a run resumes from, what retention deletes, the
RNG state round trip, every rank recording rank 0's listing of a checkpoint (two processes), and
EBT's replay store: one file per rank, exact resume, checkpoints from before the store files,
another world size. (Real DeepSpeed checkpoints, kill -9 and an interrupted write are exercised
end to end in test_train_preemption.py.)

Run as a script under torchrun it is the worker of the two-process listing test:

    torchrun --nproc_per_node=2 tests/test_checkpoint.py TAG_DIR
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import trainer_runs as runs
from common.fileio import atomic_write, atomic_write_text
from numerics import assert_rounding_close
from pretrain.models import resolve
from pretrain.models.replay import LEGACY_REPLAY_BUFFERS, ReplayStore, replay_store_bytes
from pretrain.training import checkpoint
from pretrain.training.checkpoint import layout


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
    assert layout.newest_complete(ckpt).name == "step_00001000"


def test_retention_keeps_the_newest_complete_ones(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (4, 8, 12):
        make(ckpt, step)
    make(ckpt, 6, complete=False)   # left by a crash: older than the newest complete one
    make(ckpt, 16, complete=False)  # newer: could be a write in progress, left alone
    layout.prune(ckpt, keep=2)
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


# --- every rank records rank 0's listing ---------------------------------------------------------

def test_every_rank_records_rank_0s_listing_of_a_checkpoint(tmp_path):
    """Two processes record a checkpoint's files while rank 1 sees a file rank 0 did not list
    (on a network file system, attribute caching can give ranks different listings): every file
    of rank 0's listing is hashed, and both ranks get the same record. (Each rank splitting its
    own listing left files to no rank.)"""
    tag_dir = tmp_path / "step_00000004"
    tag_dir.mkdir()
    g = torch.Generator().manual_seed(0)
    for i, name in enumerate(("b.pt", "c.pt", "d.pt", "e.pt")):
        data = torch.randint(0, 256, (1000 + i,), generator=g, dtype=torch.uint8)
        (tag_dir / name).write_bytes(data.numpy().tobytes())
    result = subprocess.run(runs.torchrun_command([__file__, str(tag_dir)]), env=runs.child_env(), cwd=runs.REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / f"record.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert records[0] == records[1]
    for name in ("b.pt", "c.pt", "d.pt", "e.pt"):
        path = tag_dir / name
        assert records[0].get(name) == [path.stat().st_size, layout.file_digest(path)], name


def _record_worker(tag_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        time.sleep(2)  # rank 0 is in record_files by now, its listing taken if it lists on entry
        (tag_dir / "a_late.pt").write_bytes(b"appeared late")
    files = checkpoint.record_files(tag_dir)
    (tag_dir.parent / f"record.rank{rank}.json").write_text(json.dumps(files))
    dist.barrier()
    dist.destroy_process_group()


# --- EBT's replay store ----------------------------------------------------------------------------

S2_COMPACT = ["model.flavor=ebt-s2-tiny", "model.overrides.replay_top_k=8", "optimizer.decay=all",
              "optimizer.weight_decay=0.01", "zero.stage=2", "train.max_steps=8"]
"""EBT S2 with a compact store (8 of the character vocabulary's 128 ids kept) on the test config:
2 processes, 8 steps, checkpoints at 4 and 8."""


def s2_checkpoint(name: str, step: int = 4) -> Path:
    return runs.run_dir(name) / "ckpt" / checkpoint.tag_for(step)


def to_layout_before_store_files(tag_dir: Path) -> None:
    """Rewrite a checkpoint the way the trainer wrote it before the replay store files: each
    rank's replay buffer (whole logits) among its module buffers, rank 0's in DeepSpeed's model
    states too, and the marker's record of the files to match."""
    marker = checkpoint.Marker.read(tag_dir)
    config = resolve(marker.config.model.flavor, marker.model_config)
    stores = [ReplayStore.saved(config, torch.load(checkpoint.state_file(tag_dir, "replay_store", rank)))
              for rank in range(marker.world_size)]
    for rank, store in enumerate(stores):
        rows, length = store.tensors["lengths"].numel(), config.block_size
        logits = torch.zeros(rows, length, config.vocab_size)
        for slot in store.youngest_first():
            logits[slot, :length] = store.candidates(torch.tensor([slot]), length)[0]
        legacy = dict(zip(LEGACY_REPLAY_BUFFERS, (store.tensors["tokens"], store.tensors["targets"], logits,
                                                  store.tensors["lengths"], torch.tensor(store.next))))
        files = [checkpoint.rank_state_file(tag_dir, rank)]
        if rank == 0:
            files.append(tag_dir / "mp_rank_00_model_states.pt")
        for path in files:
            state = torch.load(path, weights_only=False)
            state["buffers" if path.name.startswith("rank_state") else "module"].update(legacy)
            torch.save(state, path)
        checkpoint.state_file(tag_dir, "replay_store", rank).unlink()
    marker.files = checkpoint.record_files(tag_dir)
    atomic_write_text(tag_dir / checkpoint.MARKER, marker.to_json())


@pytest.fixture(scope="module")
def s2_runs() -> dict[str, str]:
    """`s2` trained 8 steps on 2 processes; then, in one launch, `resumed` from its step 4 and
    `legacy` from a copy of that checkpoint in the layout before the store files."""
    names = {"s2": "replay-s2", "resumed": "replay-s2-resumed", "legacy": "replay-s2-legacy"}
    result = subprocess.run(runs.train_command([*S2_COMPACT, f"run_name={names['s2']}"]), env=runs.child_env(),
                            cwd=runs.REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    legacy = runs.workspace() / "replay-legacy" / checkpoint.tag_for(4)
    shutil.rmtree(legacy.parent, ignore_errors=True)
    shutil.copytree(s2_checkpoint(names["s2"]), legacy)
    to_layout_before_store_files(legacy)
    plan = runs.workspace() / "replay-plan.json"
    plan.write_text(json.dumps({"config": str(runs.base_config_file()), "runs": [
        {"overrides": [*S2_COMPACT, f"run_name={names[run]}", f"resume={source}"],
         "record": str(runs.workspace() / names[run])}
        for run, source in (("resumed", s2_checkpoint(names["s2"])), ("legacy", legacy))]}))
    worker = str(runs.REPO / "tests" / "elastic_worker.py")
    result = subprocess.run(runs.torchrun_command([worker, str(plan)]), env=runs.child_env(), cwd=runs.REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return names


def test_a_compact_replay_store_resumes_bit_identically(s2_runs):
    reference = runs.scalars(s2_runs["s2"], "train/loss")
    resumed = runs.scalars(s2_runs["resumed"], "train/loss")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == reference[step], f"step {step}: resumed {loss!r} != uninterrupted {reference[step]!r}"


def test_each_rank_saves_its_replay_store_once_in_a_file_of_its_own(s2_runs):
    tag_dir = s2_checkpoint(s2_runs["s2"])
    marker, damage = checkpoint.check_intact(tag_dir)  # every recorded checksum, read back
    assert damage == [] and sorted(marker.files) == layout.checkpoint_files(tag_dir)
    config = resolve(marker.config.model.flavor, marker.model_config)
    stores = [ReplayStore.saved(config, torch.load(checkpoint.state_file(tag_dir, "replay_store", rank))) for rank in (0, 1)]
    for rank, store in enumerate(stores):
        path = checkpoint.state_file(tag_dir, "replay_store", rank)
        assert path.name in marker.files and store.top_k == 8 and "logits" not in store.tensors
        # 4 steps x 2 micro-batches x 2 rows stored; the file holds the store once (plus torch.save's framing)
        assert len(store.youngest_first()) == 16
        assert replay_store_bytes(config) <= path.stat().st_size < replay_store_bytes(config) + 20_000
    assert not torch.equal(stores[0].tensors["tokens"], stores[1].tensors["tokens"])  # per-rank rows
    for path in (tag_dir / "mp_rank_00_model_states.pt", *tag_dir.glob("rank_state_*.pt")):
        state = torch.load(path, weights_only=False)
        names = state["module"] if "module" in state else state["buffers"]
        assert not any("replay" in name for name in names), path.name


def test_a_checkpoint_from_before_the_store_files_resumes_with_each_ranks_rows(s2_runs):
    """Only rounding differs: the kept distributions went through whole logits and back."""
    reference = runs.scalars(s2_runs["s2"], "train/loss")
    legacy = runs.scalars(s2_runs["legacy"], "train/loss")
    assert sorted(legacy) == [5, 6, 7, 8]
    assert_rounding_close(torch.tensor([legacy[s] for s in sorted(legacy)]),
                          torch.tensor([reference[s] for s in sorted(legacy)]))


def test_a_resume_on_another_world_size_deals_the_replay_rows_out(s2_runs):
    result = runs.train_here([*S2_COMPACT, "run_name=replay-s2-one-process",
                              f"resume={s2_checkpoint(s2_runs['s2'])}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("EBT's replay buffers of 2 process(es) are dealt out over 1: every saved row goes to one "
            "process, which keeps its youngest 48") in result.stdout
    losses = runs.scalars("replay-s2-one-process", "train/loss")
    assert sorted(losses) == [5, 6, 7, 8] and all(np.isfinite(list(losses.values())))


if __name__ == "__main__":
    _record_worker(Path(sys.argv[1]))
