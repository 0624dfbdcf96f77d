"""Sharded DeepSpeed checkpoints with a completion marker, retention and exact-resume state.

Layout of a run's `ckpt/` directory:

    ckpt/step_00000200/          one DeepSpeed checkpoint (model + optimizer shards, client state)
        rank_state_00000.pt      per-process state: RNG states (python, numpy, torch, CUDA), ...
        complete.json            written by rank 0 after every rank finished writing
    ckpt/latest                  tag of the newest complete checkpoint, replaced atomically

A checkpoint without `complete.json` was interrupted while being written and is never resumed
from. DeepSpeed's own `latest` writing is switched off (it would point at a checkpoint before
all ranks are done).

ZeRO shards the optimizer state by rank, so a checkpoint resumed at another world size or ZeRO
stage is first converted, once, to DeepSpeed's universal format (one file per parameter and
state, independent of the partitioning), stored inside it:

    ckpt/step_00000200/universal/    made by the first resume that needs it, then reused"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pretrain.fileio import atomic_write, atomic_write_text

MARKER = "complete.json"
LATEST = "latest"
UNIVERSAL = "universal"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or converted; the message is one line."""


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
        atomic_write_text(tag_dir / MARKER, json.dumps(marker))
        atomic_write_text(ckpt_dir / LATEST, tag_dir.name)
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


def needs_universal(tag_dir: Path, world_size: int, zero_stage: int) -> bool:
    """Whether checkpoint `tag_dir` must be loaded through its universal form: ZeRO's optimizer
    shards fit only the world size and stage that wrote them. Without ZeRO (stage 0) every rank
    holds the whole state, so any world size loads it as saved. A change to or from stage 0
    cannot be converted (the universal format holds ZeRO optimizer state): ValueError with a
    one-line message saying what works instead."""
    marker = read_marker(tag_dir)
    saved_world, saved_stage = marker["world_size"], marker["config"]["zero"]["stage"]
    if saved_stage == zero_stage:
        return zero_stage > 0 and saved_world != world_size
    if saved_stage == 0:
        raise ValueError(f"zero.stage={zero_stage}: checkpoint {tag_dir} was saved without ZeRO "
                         "(stage 0), whose optimizer state cannot be converted to ZeRO shards; resume "
                         "it with zero.stage=0 (on any number of processes)")
    if zero_stage == 0:
        raise ValueError(f"zero.stage=0: checkpoint {tag_dir} holds ZeRO-{saved_stage} shards, which "
                         "only a ZeRO optimizer loads; resume it with zero.stage=1, 2 or 3 (on any "
                         "number of processes: the shards are converted automatically)")
    return True


def ensure_universal(tag_dir: Path) -> Path:
    """The universal form of checkpoint `tag_dir`, made once: rank 0 converts into a staging
    directory and renames it into place, the other ranks wait for the outcome (a failure is
    raised on every rank). Collective: every rank must call it."""
    target = tag_dir / UNIVERSAL
    error = None
    if dist.get_rank() == 0 and not target.is_dir():
        try:
            _convert_to_universal(tag_dir, target)
        except Exception as e:  # reported on every rank below
            error = f"{tag_dir}: conversion to a universal checkpoint failed ({type(e).__name__}: {e})"
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])
    return target


def _convert_to_universal(tag_dir: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process: its worker pools would fork a training
    process (threads, maybe CUDA). It walks the whole checkpoint directory, so staging
    directories of killed conversions are removed first."""
    from deepspeed.checkpoint import ds_to_universal

    for stale in tag_dir.glob(f".{UNIVERSAL}.incomplete-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = tag_dir / f".{UNIVERSAL}.incomplete-{socket.gethostname()}-{os.getpid()}"
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(staging / UNIVERSAL),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    _warn(f"converting {tag_dir} to DeepSpeed's universal checkpoint format (once)")
    try:
        log = io.StringIO()  # its step-by-step prints and progress bars
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
        _readable_by_every_stage(staging / UNIVERSAL)
        os.replace(staging / UNIVERSAL, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


MODEL_STATES_BY_STAGE = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""The model-states file a universal load reads (metadata and client state only): ZeRO 1-2
engines look for the first name, ZeRO-3 engines for the second."""


def _readable_by_every_stage(universal_dir: Path) -> None:
    """Complete a universal checkpoint so that ZeRO 1-2 and ZeRO-3 both load it, whichever
    wrote it. DeepSpeed's two loaders read different parts: the model-states file under two
    names (given both, as a hard link where the filesystem has them); Adam's step count from a
    `step.pt` per parameter (ZeRO 1-2; a ZeRO-3 conversion writes none) or from the optimizer
    state dict in `optimizer_state.pt` (ZeRO-3; a ZeRO 1-2 conversion leaves it out); ZeRO 1-2
    also want each state tensor wrapped in a dict (a ZeRO-3 conversion stores it bare) and a
    DeepSpeed version in `optimizer_state.pt`."""
    from deepspeed.checkpoint.constants import PARAM

    present = [universal_dir / name for name in MODEL_STATES_BY_STAGE if (universal_dir / name).exists()]
    for name in MODEL_STATES_BY_STAGE:
        if not (universal_dir / name).exists():
            try:
                os.link(present[0], universal_dir / name)
            except OSError:
                shutil.copy2(present[0], universal_dir / name)
    zero = universal_dir / "zero"
    optimizer_file = zero / "optimizer_state.pt"
    optimizer_state = torch.load(optimizer_file, weights_only=False)
    param_dirs = [d for d in zero.iterdir() if (d / "exp_avg.pt").exists()]
    if "optimizer_state_dict" in optimizer_state:  # written from ZeRO-3
        step = optimizer_state["optimizer_state_dict"]["state"][0]["step"]
        for param_dir in param_dirs:
            torch.save(step, param_dir / "step.pt")
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                tensor = torch.load(param_dir / f"{key}.pt", weights_only=False)
                torch.save({PARAM: tensor}, param_dir / f"{key}.pt")
        model_states = torch.load(present[0], map_location="cpu", weights_only=False)
        optimizer_state["ds_version"] = model_states["ds_version"]
        torch.save(optimizer_state, optimizer_file)
    else:  # written from ZeRO 1-2
        step = torch.load(param_dirs[0] / "step.pt", weights_only=False)
        optimizer_state["optimizer_state_dict"] = {"state": {0: {"step": step}},
                                                   "param_groups": optimizer_state["param_groups"]}
        torch.save(optimizer_state, optimizer_file)


def load(engine, tag_dir: Path, universal: bool = False) -> tuple[dict, dict | None]:
    """Load model and optimizer from `tag_dir`, through its universal form (made on first use)
    if `universal`; returns the client state and this rank's own saved state (RNG states,
    buffers), None if the checkpoint has none for this rank. Collective: every rank must call it."""
    source = ensure_universal(tag_dir) if universal else tag_dir
    groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    # DeepSpeed reads this switch from its config at load time; it is set per load because one
    # engine can resume from a universal checkpoint and later reload one of its own checkpoints.
    engine._config.load_universal_checkpoint = universal
    load_path, client_state = engine.load_checkpoint(str(source.parent), tag=source.name,
                                                     load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag_dir}")
    if universal:
        # DeepSpeed's ZeRO-3 universal load gives every param group the first group's settings
        # (weight decay differs per group) and one shared step tensor, which AdamW then advances
        # once per group: keep the groups' own settings and give each its own step.
        for group, settings in zip(engine.optimizer.param_groups, groups, strict=True):
            group.update(settings)
        for state in engine.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    return client_state, read_rank_state(tag_dir, dist.get_rank())


def read_rank_state(tag_dir: Path, rank: int) -> dict | None:
    """The state `rank` saved in `tag_dir` (RNG states, buffers), None if it saved none."""
    path = rank_state_file(tag_dir, rank)
    return torch.load(path, weights_only=False) if path.exists() else None


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
