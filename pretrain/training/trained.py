"""A trained model, loaded for use (evaluation, sampling, export) rather than for resuming.

    trained = load_trained(RUN_DIR | CHECKPOINT_DIR | FILE.safetensors | HF_EXPORT_DIR, device="cpu", dtype="fp32")
    trained.model(idx).logits; trained.tokenizer.encode(text)

The source is a run directory (its newest complete checkpoint), one checkpoint directory, a
safetensors file written by `python -m pretrain.export`, or a Hugging Face directory written by
`python -m pretrain.export --format hf`. Sampling, evaluation and the exports
all load through here, so they see the same weights and the same tokenizer."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from common import objectstore
from common.fileio import read_json
from pretrain.config import to_dict
from pretrain.hf.load import read_export, tensors_for
from pretrain.models import FamilySpec, build, family_name, family_spec, resolve
from pretrain.models.weights import LoadError, load_weights, read_safetensors
from pretrain.training import checkpoint
from pretrain.training.summary import SUMMARY_FILE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RUN_ENTRIES = ("ckpt", "tb", "config.yaml", SUMMARY_FILE)
"""What the trainer writes into a run directory: a directory holding any of them is a run."""
TRAINER_DIRS = ("ckpt", "tb")
"""The parts of a run directory that the trainer rewrites and prunes (a stale step_N directory is
removed before step N is saved, retention deletes checkpoints, a resume purges TensorBoard's later
points): the commands that write for the user (export, dynamics) write nothing inside them."""


def is_run_directory(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_ENTRIES)


def inside_trainer_directory(out: str | Path) -> str | None:
    """Why a command may not write `out`, when it lies in a run's ckpt/ or tb/ (`TRAINER_DIRS`),
    as the end of its one-line error ("--out OUT " + this); None elsewhere."""
    target = Path(out).resolve()
    inside = next((p for p in target.parents if p.name in TRAINER_DIRS and is_run_directory(p.parent)), None)
    if inside is None:
        return None
    return f"lies in {inside}, which the training run manages; choose a path outside it"


@dataclass
class TrainedModel:
    model: nn.Module
    """The model in eval mode, on the requested device and dtype."""
    flavor: str
    """Registered flavor name, e.g. "nrgpt-tiny"."""
    model_config: Any
    """The family config the model was built from."""
    step: int
    """Optimizer steps the weights were trained for."""
    source: Path
    """The checkpoint directory or file the weights came from."""
    run_config: dict
    """The run's saved config (as written in the checkpoint marker or the export's metadata)."""
    manifest: dict | None
    """The training data's manifest (tokenizer and vocabulary), None if it cannot be found."""

    @property
    def family(self) -> str:
        return family_name(self.model_config)

    @property
    def spec(self) -> FamilySpec:
        """What the commands know of the model's family (`FamilySpec`)."""
        return family_spec(self.model_config)

    @property
    def tokenizer(self):
        """The tokenizer the model was trained with (from the data manifest)."""
        from data_pipeline.tokenizer import tokenizer_from_spec

        if self.manifest is None:
            raise LoadError(f"{self.source}: the training data's manifest (its tokenizer) was not found")
        return tokenizer_from_spec(self.manifest)


def consolidated_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights (and buffers) of one checkpoint."""
    if checkpoint.Marker.read(tag_dir).config.zero.stage == 0:
        # without ZeRO every rank holds the whole model; the model-states file has it
        module = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)["module"]
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    # DeepSpeed narrates the consolidation (and, when first imported, its choice of accelerator)
    # on stdout, which belongs to the caller (the sampling command's text): its notes are dropped,
    # and a logger it creates meanwhile writes to stderr from then on
    notes = io.StringIO()
    try:
        with contextlib.redirect_stdout(notes), contextlib.redirect_stderr(notes):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    finally:
        for handler in logging.getLogger("DeepSpeed").handlers:
            if getattr(handler, "stream", None) is notes:
                handler.setStream(sys.stderr)


def refuse_url(source: str | Path) -> None:
    """A run given as a URL is read from a local copy: the one line saying how to make it (s3://),
    or that the scheme is not supported."""
    if objectstore.is_remote(source):
        raise LoadError(f"{source}: a run in an object store is read from a local copy; fetch its newest complete "
                        f"checkpoint first (python -m pretrain.fetch {source} RUN_DIR), then give RUN_DIR")
    problem = objectstore.unsupported_url(source, "run", remote_ok=False)
    if problem:
        raise LoadError(problem)


def find_trained_checkpoint(source: str | Path) -> Path:
    """The checkpoint directory `source` names: itself, or the newest complete one of a run
    directory or its `ckpt/`."""
    refuse_url(source)
    path = Path(source)
    if not path.exists():
        raise LoadError(f"{source}: no such run directory, checkpoint or file")
    try:
        tag_dir = checkpoint.find_checkpoint(str(path), path / "ckpt")
    except ValueError:
        tag_dir = None
    if tag_dir is None:
        raise LoadError(f"{source}: no complete checkpoint found (a run directory, one of its "
                        "ckpt/step_* directories, an exported .safetensors file or an exported Hugging Face "
                        "directory is expected)")
    _, damage = checkpoint.check_intact(tag_dir)
    if damage:
        raise LoadError(f"{source}: checkpoint {tag_dir.name} is damaged: {', '.join(damage)}")
    return tag_dir


def _read_manifest(data_path: str | None) -> dict | None:
    if not data_path:
        return None
    if objectstore.is_remote(data_path):
        from data_pipeline.errors import DataError
        from data_pipeline.packing import existing_manifest

        try:
            return existing_manifest(data_path)
        except DataError as e:
            raise LoadError(str(e)) from None
    file = Path(data_path) / "manifest.json"
    return read_json(file, LoadError) if file.is_file() else None


def inference_device(name: str | torch.device) -> torch.device:
    """The device `name` names (cpu, cuda, cuda:N), if this machine has it; LoadError if not."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LoadError(f"device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LoadError(f"device {name!r}: expected cpu, cuda or cuda:N")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= visible:
        raise LoadError(f"device {name}: this machine has {visible or 'no'} CUDA device{'s' * (visible != 1)}")
    return device


def load_trained(source: str | Path, device: str | torch.device = "cpu", dtype: str = "fp32") -> TrainedModel:
    """Load the model `source` names (see the module docstring) for inference."""
    device = inference_device(device)
    if dtype not in DTYPES:
        raise LoadError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    path, manifest = Path(source), None
    if path.is_file() and path.suffix == ".safetensors":
        state, metadata = read_safetensors(path, export_only=True)
        flavor, raw_model_config = metadata["flavor"], json.loads(metadata["model_config"])
        run_config = json.loads(metadata.get("run_config", "{}"))
        step = int(metadata.get("step", 0))
    elif (path / "config.json").is_file():
        run = read_export(path)
        flavor, raw_model_config, step, run_config = run["flavor"], run["model_config"], run["step"], run["run_config"]
        manifest = run["manifest"]  # carried along: the data directory may not exist where it is used
        state = None  # read for the model config below: native exports name weights their way
    else:
        path = find_trained_checkpoint(source)
        marker = checkpoint.Marker.read(path)
        run_config, raw_model_config = to_dict(marker.config), marker.model_config
        flavor, step = marker.config.model.flavor, marker.step
        state = consolidated_state_dict(path)
    model_cfg = resolve(flavor, raw_model_config)
    model = build(model_cfg)
    origin = None
    if state is None:
        state, origin, _ = tensors_for(path, model_cfg)
    load_weights(model, state, path, origin)
    model.to(device=device, dtype=DTYPES[dtype]).eval()
    manifest = manifest or _read_manifest(run_config.get("data", {}).get("path"))
    return TrainedModel(model=model, flavor=flavor, model_config=model_cfg, step=step, source=path,
                        run_config=run_config, manifest=manifest)


def run_dir_of(checkpoint_or_file: Path) -> Path | None:
    """The run directory a checkpoint belongs to (RUN/ckpt/<tag>); None for an export."""
    if checkpoint_or_file.is_dir() and checkpoint_or_file.parent.name == "ckpt":
        return checkpoint_or_file.parent.parent
    return None


def results_file(checkpoint_or_file: Path) -> Path:
    """Where `python -m pretrain.evaluate` writes its results JSON without --out:
    RUN_DIR/downstream/<tag>.json for a run's checkpoint (the model card of an export shows it),
    next to an export otherwise."""
    run_dir = run_dir_of(checkpoint_or_file)
    if run_dir is None:
        return checkpoint_or_file.with_suffix(".downstream.json")
    return run_dir / "downstream" / f"{checkpoint_or_file.name}.json"
