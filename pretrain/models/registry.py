"""The registry of model families and their named flavors."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

_FAMILIES: dict[type, type[nn.Module]] = {}
_FAMILY_NAMES: dict[type, str] = {}
FLAVORS: dict[str, Any] = {}
"""Flavor name -> family config instance (treat as read-only; `resolve` returns copies)."""


def register_family(name: str, config_cls: type, model_cls: type[nn.Module]) -> None:
    """`name` is the family as runs, summaries and scaling fits call it (e.g. "nrgpt")."""
    _FAMILIES[config_cls] = model_cls
    _FAMILY_NAMES[config_cls] = name


def register_flavor(name: str, config: Any) -> None:
    if name in FLAVORS:
        raise ValueError(f"flavor {name!r} registered twice")
    FLAVORS[name] = config


def resolve(flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's config with `overrides` applied; unknown flavors and keys are errors."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; known: {', '.join(sorted(FLAVORS))}")
    config = FLAVORS[flavor]
    names = {f.name for f in dataclasses.fields(config)}
    for key in overrides or {}:
        if key not in names:
            raise ValueError(f"model override {key!r} is not a field of {type(config).__name__}")
    return dataclasses.replace(config, **(overrides or {}))


def padded_vocab(dataset_vocab_size: int) -> int:
    """The model's embedding rows for a dataset vocabulary: a multiple of 64 for fast matmuls."""
    return -(-dataset_vocab_size // 64) * 64


def model_class(config: Any) -> type[nn.Module]:
    """The model class of the family that `config` belongs to."""
    try:
        return _FAMILIES[type(config)]
    except KeyError:
        raise ValueError(f"no model family registered for {type(config).__name__}") from None


def family_name(config: Any) -> str:
    """The registered family name of `config` (e.g. "gpt_rec")."""
    model_class(config)  # the same error for an unregistered config
    return _FAMILY_NAMES[type(config)]


def build(config: Any) -> nn.Module:
    """Instantiate the model of the family that `config` belongs to."""
    return model_class(config)(config)
