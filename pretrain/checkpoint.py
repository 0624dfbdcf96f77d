"""Sharded DeepSpeed checkpoints with a completion marker, retention and exact-resume state.

Layout of a run's `ckpt/` directory:

    ckpt/step_00000200/          one DeepSpeed checkpoint (model + optimizer shards, client state)
        rank_state_00000.pt      per-process state: RNG states (python, numpy, torch, CUDA), ...
        complete.json            written by rank 0 after every rank finished writing
    ckpt/latest                  tag of the newest complete checkpoint, replaced atomically

A checkpoint without `complete.json` was interrupted while being written and is never resumed
from. DeepSpeed's own `latest` writing is switched off (it would point at a checkpoint before
all ranks are done)."""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

MARKER = "complete.json"
LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_state_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rank_state_{rank:05d}.pt"


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / MARKER).is_file()


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, warning (on rank 0) about newer incomplete ones it skips."""
    for tag_dir in reversed(list_checkpoints(ckpt_dir)):
        if is_complete(tag_dir):
            return tag_dir
        _warn(f"skipping incomplete checkpoint {tag_dir} (its write was interrupted)")
    return None


def _warn(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def find_checkpoint(resume: str, ckpt_dir: Path) -> Path | None:
    """The checkpoint to resume from: `resume` is "auto" (the run's newest complete checkpoint,
    or None for a fresh start), "never" (None) or a path to a checkpoint, a `ckpt/` directory or
    a run directory (its newest complete checkpoint; an error if it has none)."""
    if resume == "never":
        return None
    if resume == "auto":
        return newest_complete(ckpt_dir)
    path = Path(resume)
    if path.name.startswith("step_"):
        if not is_complete(path):
            raise ValueError(f"resume={resume}: checkpoint is incomplete (no {MARKER})")
        return path
    for candidate in (path / "ckpt", path):
        found = newest_complete(candidate)
        if found is not None:
            return found
    raise ValueError(f"resume={resume}: no complete checkpoint found there")


def atomic_write(path: Path, write) -> None:
    """`write(tmp)` a temporary file next to `path`, then rename it into place: readers see the
    old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save(engine, ckpt_dir: Path, step: int, client_state: dict, rank_state: dict, keep: int,
         marker: dict) -> Path:
    """Write checkpoint `step` on every rank (`rank_state` is this rank's own extra state), then
    mark it complete (the marker holds `marker`, e.g. the config, readable without loading the
    checkpoint), point `latest` at it and delete checkpoints beyond the newest `keep`.
    Collective: every rank must call it."""
    rank = dist.get_rank()
    tag_dir = ckpt_dir / tag_for(step)
    if rank == 0 and tag_dir.exists():  # left over by a run killed while writing this step
        shutil.rmtree(tag_dir)
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag_dir.name, client_state=client_state,
                           save_latest=False)
    rank_state = {**rank_state, "rng": capture_rng()}
    atomic_write(rank_state_file(tag_dir, rank), lambda tmp: torch.save(rank_state, tmp))
    dist.barrier()
    if rank == 0:
        marker = {"step": step, "world_size": dist.get_world_size(), "time": time.time(), **marker}
        atomic_write(tag_dir / MARKER, lambda tmp: tmp.write_text(json.dumps(marker)))
        atomic_write(ckpt_dir / LATEST, lambda tmp: tmp.write_text(tag_dir.name))
        _prune(ckpt_dir, keep)
    return tag_dir


def _prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and older incomplete ones."""
    tag_dirs = list_checkpoints(ckpt_dir)
    complete = [p for p in tag_dirs if is_complete(p)]
    kept = set(complete[-keep:])
    for tag_dir in tag_dirs:
        if tag_dir not in kept and tag_dir.name < complete[-1].name:
            shutil.rmtree(tag_dir, ignore_errors=True)


def read_marker(tag_dir: Path) -> dict:
    return json.loads((tag_dir / MARKER).read_text())


def load(engine, tag_dir: Path) -> tuple[dict, dict | None]:
    """Load model and optimizer from `tag_dir` and restore this rank's RNG states; returns the
    client state and this rank's extra state (None if the checkpoint has none for this rank).
    Collective: every rank must call it."""
    load_path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                     load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    rank_file = rank_state_file(tag_dir, dist.get_rank())
    if not rank_file.exists():
        _warn(f"{rank_file.name} missing in {tag_dir} (saved with another world size?): "
              "the random streams of rank(s) without one restart from the seed")
        return client_state, None
    rank_state = torch.load(rank_file, weights_only=False)
    restore_rng(rank_state.pop("rng"))
    return client_state, rank_state


def capture_rng() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
