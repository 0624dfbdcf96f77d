"""Reading weights into a model, for every way one is loaded for use: the consolidated export
(`trained`), a Hugging Face directory (`hf.load`) and `model.init_from`."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from pretrain.models.ebt import LEGACY_REPLAY_BUFFERS


class LoadError(ValueError):
    """A source that holds no usable trained model; the message is one line."""


def read_safetensors(file: Path, export_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; LoadError when it is not one or is damaged (cut
    short, a broken header), and with `export_only` when it is not a `pretrain.export` file (no
    flavor in its metadata), before its tensors are read. The format has no checksum: changed
    tensor bytes go unseen."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            if export_only and "flavor" not in metadata:
                raise LoadError(f"{file}: not a model exported by pretrain.export (no flavor in its metadata)")
            return {name: f.get_tensor(name) for name in f.keys()}, metadata
    except (SafetensorError, OSError) as e:
        raise LoadError(f"{file}: not a readable safetensors file ({e})") from None


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                 origin: dict[str, str] | None = None) -> None:
    """Load `tensors` (keys of `model.state_dict()`) into `model`: every parameter must be there
    with its shape and nothing else may be (the message names the tensor, as `origin` maps our
    key to the source's name); buffers the source lacks keep their values."""
    origin = origin or {}
    expected = model.state_dict()
    # EBT checkpoints from before the replay store hold its rows as buffers: training state that
    # a model loaded for use does not need.
    tensors = {name: t for name, t in tensors.items() if name.rsplit(".", 1)[-1] not in LEGACY_REPLAY_BUFFERS}
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
