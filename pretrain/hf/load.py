"""Read a local Hugging Face directory into one of our models: a native GPT-2 or Llama
checkpoint of matching shape, or an export of this project (`model.init_from`, `load_trained`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.fileio import read_json, sha256_hex
from pretrain.hf import native
from pretrain.models import family_name
from pretrain.models.weights import LoadError, load_weights, read_safetensors

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
RUN_FILE = "training_run.json"
"""Written by the export (`pretrain.training.export_hf`): what the directory was made from."""
CHECKSUM_FILE = "SHA256SUMS"
"""Written by the export: the digests of every other file, in `sha256sum`'s format, so that a copy
moved between machines or hubs is checked with `sha256sum -c SHA256SUMS` in the directory; loading
an export verifies it (`verify_checksums`)."""
CODE_PREFIX = "model."
"""State-dict prefix of the exports that carry their code (`modeling.ExportedForCausalLM.model`)."""


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_config(directory: Path) -> dict[str, Any]:
    """config.json; for native types as transformers reads it (its defaults filled in)."""
    raw = read_json(directory / "config.json", LoadError)
    if raw.get("model_type") in native.ARCHITECTURES:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(directory), local_files_only=True).to_dict()
    return raw


def verify_checksums(directory: Path) -> None:
    """LoadError naming the files of an export that no longer match its SHA256SUMS (changed,
    damaged, missing), before anything of it is read; a directory without SHA256SUMS (not an
    export of this project) has nothing to check."""
    file = directory / CHECKSUM_FILE
    if not file.is_file():
        return
    try:
        listed = [line.split("  ", 1) for line in file.read_text().splitlines() if line]
        expected = {name: digest for digest, name in listed}
    except (OSError, UnicodeDecodeError, ValueError):
        raise LoadError(f"{file}: not a readable checksum list (two columns: digest, file name); "
                        "copy the export again or export the run again") from None
    damaged = [f"{name} ({'missing' if not (directory / name).is_file() else 'checksum mismatch'})"
               for name, digest in sorted(expected.items())
               if not (directory / name).is_file() or sha256_hex(directory / name) != digest]
    if damaged:
        raise LoadError(f"{directory}: {', '.join(damaged)} against {CHECKSUM_FILE}: changed or damaged after "
                        "the export; copy it again or export the run again")


def read_export(directory: Path) -> dict[str, Any]:
    """The training_run.json of an export of this project, once its files are verified against
    their checksums."""
    file = directory / RUN_FILE
    if not file.is_file():
        raise LoadError(f"{directory}: a Hugging Face directory without {RUN_FILE}, i.e. not written by "
                        "pretrain.export (to train from it, use model.init_from)")
    verify_checksums(directory)
    return read_json(file, LoadError)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors weights (one file or an indexed set)."""
    if (directory / WEIGHTS_FILE).is_file():
        return read_safetensors(directory / WEIGHTS_FILE)[0]
    if (directory / WEIGHTS_INDEX).is_file():
        files = sorted(set(read_json(directory / WEIGHTS_INDEX, LoadError)["weight_map"].values()))
        return {name: t for file in files for name, t in read_safetensors(directory / file)[0].items()}
    raise LoadError(f"{directory}: no {WEIGHTS_FILE} (or {WEIGHTS_INDEX}); only safetensors weights are read")


def tensors_for(directory: Path, model_config: Any) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """(tensors under our state_dict keys, our key -> the name in the directory, notes) for a
    model of `model_config`; raises LoadError when the directory's model computes another
    function than a model of that config would."""
    config = read_config(directory)
    model_type, family = config.get("model_type"), family_name(model_config)
    tensors = read_tensors(directory)
    if model_type in native.ARCHITECTURES:
        if native.hf_model_type(model_config) != model_type:
            raise LoadError(f"{directory} holds a {model_type} model; the run's family {family} "
                            f"cannot load it (gpt loads gpt2, transformer_pp loads llama)")
        errors, notes = native.config_mismatches(config, model_config)
        if errors:
            raise LoadError(f"{directory}: {errors[0]}")
        ours, origin = native.from_hf(tensors, config, model_config)
        return ours, origin, notes
    if model_type == f"pretrain_{family}":
        differing = sorted(k for k, v in config["model_config"].items() if getattr(model_config, k, v) != v)
        notes = [f"the run's model differs from the export's config in {', '.join(differing)}"] if differing else []
        ours = {name.removeprefix(CODE_PREFIX): t for name, t in tensors.items()}
        return ours, {name.removeprefix(CODE_PREFIX): name for name in tensors}, notes
    raise LoadError(f"{directory}: model_type {model_type!r} cannot be loaded into a {family} model "
                    f"(expected gpt2 or llama of matching shape, or a {family} export of this project)")


def load_pretrained_weights(model: torch.nn.Module, directory: str | Path) -> list[str]:
    """`model.init_from`: load the directory's weights into the freshly built `model`; returns
    notes to print (e.g. a tanh-approximate GELU loaded into an exact one)."""
    directory = Path(directory)
    if not is_hf_directory(directory):
        raise LoadError(f"{directory}: not a Hugging Face model directory (no config.json)")
    verify_checksums(directory)
    tensors, origin, notes = tensors_for(directory, model.config)
    load_weights(model, tensors, directory, origin)
    return [f"init_from {directory}: loaded {len(tensors)} tensors"] + [f"init_from {directory}: {n}" for n in notes]
