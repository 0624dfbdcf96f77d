"""The registry of model families and their named flavors.

A family registers a `FamilySpec` next to its model: the traits and hooks through which the
machinery outside `pretrain/models/` (trainer, checkpoints, planner, evaluation, dynamics,
sampling, export) treats it, so that none of it compares a family's name or imports a family's
module. A new family is one module here that registers its spec and flavors."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn


def no_rank_states(model: nn.Module) -> dict[str, Any]:
    return {}


def no_rank_state_bytes(config: Any) -> int:
    return 0


def no_replayed_rows(config: Any, micro_batch_size: int) -> int:
    return 0


def same_config(config: Any) -> Any:
    return config


@dataclass(frozen=True)
class FamilySpec:
    """What the machinery knows of a model family: its traits and its hooks."""

    name: str
    """The family as runs, summaries and scaling fits call it (e.g. "nrgpt")."""
    config_cls: type
    """The family's config dataclass: a config's type names its family."""
    model_cls: type[nn.Module]
    """The model class that `build` makes of a config of the family."""
    recurrent: bool = False
    """Its steps apply one shared block (`model.block`), so a probe can read out after each step
    (the early exit of `pretrain.dynamics`, eval.dynamics' depth losses)."""
    step_energies: bool = False
    """Its forward gives each token's energy at every step (`return_energies=True`), whose rises
    the dynamics count (the monotone fraction, `--transient`)."""
    thinks: bool = False
    """It predicts by a descent it can run longer or from several starts (`think`, and
    `next_token_logits` with steps, best_of, stop_tolerance): the thinking curve, the
    `--think-*` options of sampling and evaluation."""
    skips_spikes: bool = False
    """train.skip_spikes=auto turns the loss-spike guard on for it."""
    hf_model_type: str | None = None
    """The Hugging Face model_type it exports to natively where the config maps exactly (`hf/native.py`);
    None: an export always carries its code."""
    rank_states: Callable[[nn.Module], dict[str, Any]] = no_rank_states
    """A model's training state outside its module state, kept per rank: name -> an object with
    `state_dict()`, `load_state_dict(state, device)` and the dealing of saved ranks' states after a
    world-size change (`dealt_from`, `deal`: the protocol `pretrain.training.checkpoint.RankState`); each
    checkpoint saves it in a file per rank and name."""
    rank_state_bytes: Callable[[Any], int] = no_rank_state_bytes
    """Device bytes of one rank's `rank_states` for a config, which the memory planner adds."""
    rank_state_scratch_bytes: Callable[[Any], int] = no_rank_state_bytes
    """Device bytes a training step of a config allocates for a moment as its forward ends, to
    update the `rank_states` (for the planner)."""
    replayed_rows: Callable[[Any, int], int] = no_replayed_rows
    """The rows a training micro-batch of that many rows is extended by, at most (for the planner)."""
    largest_step: Callable[[Any], Any] = same_config
    """The config of the largest training step a config's run takes (draws fixed at their maximum),
    with nothing the meta device cannot build: the planner measures its activations."""
    stale_buffers: tuple[str, ...] = ()
    """Buffer names that held training state in old checkpoints: a model loaded for use drops them."""

    @property
    def descends(self) -> bool:
        """Whether its forward is a descent that the probes of `probes.py` measure."""
        return self.recurrent or self.thinks


FAMILIES: dict[str, FamilySpec] = {}
"""Family name -> its spec."""
FLAVORS: dict[str, Any] = {}
"""Flavor name -> family config instance (treat as read-only; `resolve` returns copies)."""


def register_family(spec: FamilySpec) -> None:
    FAMILIES[spec.name] = spec


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


def family_spec(config: Any) -> FamilySpec:
    """The spec of the family that `config` belongs to."""
    for spec in FAMILIES.values():  # a handful
        if spec.config_cls is type(config):
            return spec
    raise ValueError(f"no model family registered for {type(config).__name__}")


def model_class(config: Any) -> type[nn.Module]:
    """The model class of the family that `config` belongs to."""
    return family_spec(config).model_cls


def family_name(config: Any) -> str:
    """The registered family name of `config` (e.g. "gpt_rec")."""
    return family_spec(config).name


def build(config: Any) -> nn.Module:
    """Instantiate the model of the family that `config` belongs to."""
    return model_class(config)(config)
