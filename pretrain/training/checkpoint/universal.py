"""DeepSpeed's universal checkpoint format, which a resume at another world size or ZeRO stage
loads through: when it is needed, and the conversion (once per checkpoint, stored inside it)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.training.checkpoint.layout import UNIVERSAL, CheckpointError, warn


def needs_universal(saved_world: int, saved_stage: int, world_size: int, zero_stage: int,
                    tag_dir: Path) -> bool:
    """Whether a checkpoint of (saved_world, saved_stage) must be loaded through its universal
    form at (world_size, zero_stage): ZeRO's optimizer shards fit only the world size and stage
    that wrote them. Without ZeRO (stage 0) every rank holds the whole state, so any world size
    loads it as saved. A change to or from stage 0 cannot be converted (the universal format
    holds ZeRO optimizer state): ValueError with a one-line message saying what works instead."""
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
    warn(f"converting {tag_dir} to DeepSpeed's universal checkpoint format (once)")
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
