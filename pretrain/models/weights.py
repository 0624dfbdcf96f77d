"""Reading weights into a model, for every way one is loaded for use: the consolidated export
(`trained`), a Hugging Face directory (`hf.load`) and `model.init_from`."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import xxhash

from pretrain.models import family_spec


class LoadError(ValueError):
    """A source that holds no usable trained model; the message is one line."""


EXPORT_CHECKSUM = "checksum_xxh3_128"
"""Metadata key of the checksum that `pretrain.export` records in its file (the safetensors
format has none of its own): see `export_checksum`."""


def export_checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """xxh3-128 hex digest of an export's content: its metadata (but the checksum itself) and
    every tensor's name, dtype, shape and bytes, in name order. It is computed from the tensors
    rather than the file's bytes, so it does not depend on how safetensors lays them out, and
    the file can carry it in its own header."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps({k: v for k, v in metadata.items() if k != EXPORT_CHECKSUM}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def read_safetensors(file: Path, export_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; LoadError when it is not one or is damaged (cut
    short, a broken header), and with `export_only` when it is not a `pretrain.export` file (no
    flavor in its metadata), before its tensors are read. A file that records a checksum
    (`EXPORT_CHECKSUM`, every export since it was introduced) is verified against it, so changed
    tensor bytes or metadata are a LoadError too; an older export without one loads unchecked."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            if export_only and "flavor" not in metadata:
                raise LoadError(f"{file}: not a model exported by pretrain.export (no flavor in its metadata)")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoadError(f"{file}: not a readable safetensors file ({e})") from None
    if EXPORT_CHECKSUM in metadata and export_checksum(tensors, metadata) != metadata[EXPORT_CHECKSUM]:
        raise LoadError(f"{file}: checksum mismatch, its weights or metadata changed after the export "
                        "(a damaged copy?); copy it again or export the run again")
    return tensors, metadata


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                 origin: dict[str, str] | None = None) -> None:
    """Load `tensors` (keys of `model.state_dict()`) into `model`: every parameter must be there
    with its shape and nothing else may be (the message names the tensor, as `origin` maps our
    key to the source's name); buffers the source lacks keep their values."""
    origin = origin or {}
    expected = model.state_dict()
    # old checkpoints of some families hold training state as buffers (EBT's replay rows before
    # its replay store), which a model loaded for use does not need
    stale = family_spec(model.config).stale_buffers
    tensors = {name: t for name, t in tensors.items() if name.rsplit(".", 1)[-1] not in stale}
    for name, t in tensors.items():
        if name not in expected:
            raise LoadError(f"{source}: tensor {origin.get(name, name)} {list(t.shape)} has no counterpart "
                            "in the model")
        if t.shape != expected[name].shape:
            raise LoadError(f"{source}: tensor {origin.get(name, name)} has shape {list(t.shape)}, the "
                            f"model needs {list(expected[name].shape)} ({name})")
    # tied weights appear under several names; the source may hold any one of them
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    state = {**expected, **tensors}
    for names in aliases.values():
        present = [n for n in names if n in tensors]
        if not present:
            raise LoadError(f"{source}: no tensor for the model's parameter {names[0]}")
        for n in names:
            state[n] = tensors[present[0]]
    model.load_state_dict({name: t.to(expected[name].dtype) for name, t in state.items()}, strict=True)
