"""Building blocks shared by the families: the config fields every family has (`LMConfig`, with
the Llama-backbone families too) and their checks, the float32 loss, autocast and checkpointing
helpers; and for the learned-position families (GPT, GPT_Rec, NRGPT) their config fields, token +
position embedding and the final-norm readout."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pretrain.models.common import DecodeCache, LanguageModel, ModelOutput

CHECKPOINTING_MODES = ("off", "step", "block")


def check_choice(config: object, name: str, choices: tuple) -> None:
    """Raise a ValueError naming the field when `config.<name>` is not one of `choices`."""
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{type(config).__name__}.{name} must be one of {choices}, got {value!r}")


def check_positive(config: object, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"{type(config).__name__}.{name} must be > 0, "
                             f"got {getattr(config, name)!r}")


def dropout_module(p: float) -> nn.Module:
    """nn.Dropout(p), or nn.Identity at p = 0: a dropout call that does nothing still costs
    ~10 us on CPU, more than a matmul of one decoded token at the tiny widths."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in at least float32: a bf16 tensor upcast, a float32 or float64 one as it is (decided
    in Python: torch.promote_types would run an ATen op per call)."""
    return t.float() if t.dtype.itemsize < 4 else t


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of [B, T, V] logits against [B, T] targets in at least float32 (the softmax
    over the vocabulary, also when the model runs in bf16); targets of -1 are ignored.
    `reduction` is F.cross_entropy's: "mean" or "sum" over the other targets, or "none": [B, T]
    per-token losses, 0 where ignored. Every family's training loss, and the per-token losses of
    the probes and of `pretrain.dynamics` (through `token_losses`)."""
    losses = F.cross_entropy(wide(logits).flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
    return losses.view(targets.shape) if reduction == "none" else losses


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [B, R] in at least float32; ignored targets (-1) give 0."""
    return cross_entropy(logits, targets, reduction="none")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype torch.autocast runs matmuls in on `device` (train.precision=bf16-autocast), or
    None outside autocast (the meta device, which `pretrain.plan` runs on, has none)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which matmuls run in their operands' dtype also under torch.autocast, for
    the few results that bf16 would spoil."""
    return torch.autocast(device.type, enabled=False) if autocast_dtype(device) else contextlib.nullcontext()


def maybe_checkpoint(enabled: bool, fn: Callable, *args):
    """fn(*args), recomputed in backward instead of keeping its activations when `enabled`.
    Non-reentrant so that it composes with autograd.grad and keeps dropout's RNG state."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


@dataclass
class LMConfig:
    """Fields every family has (the learned-position ones and the Llama backbone's)."""

    vocab_size: int = 50304
    """Vocabulary size (the trainer sets it from the data manifest, padded to a multiple of 64)."""
    block_size: int = 1024
    """Context length: the longest sequence the model accepts (the number of learned positions
    where positions are learned)."""
    n_embd: int = 768
    """Model width D."""
    n_head: int = 12
    """Number of attention heads."""
    dropout: float = 0.0
    """Dropout probability; where it applies is the family's (GPT: the embeddings, attention
    and residual branches; NRGPT: `dropout_placement`; the Llama backbone: the attention and MLP
    outputs)."""
    activation_checkpointing: str = "off"
    """"off", "step" (each recurrent or descent step) or "block" (each transformer block),
    recomputed in backward (non-reentrant); a family without steps treats "step" as "block"."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights (residual
    output projections get init_std / sqrt(2 depth))."""

    EXECUTION_FIELDS: ClassVar[tuple[str, ...]] = ("activation_checkpointing",)
    """The fields that choose how the model computes, not what it computes or which parameters
    and buffers it has: a resume may change them (e.g. checkpointing on for GPUs with less memory)."""

    @property
    def sdpa_head_dim(self) -> int | None:
        """The head dim of the attention that training runs through SDPA (None: none; see
        `models.sdpa`)."""
        return None

    def __post_init__(self):
        check_positive(self, "vocab_size", "block_size", "n_embd", "n_head", "init_std")
        check_choice(self, "activation_checkpointing", CHECKPOINTING_MODES)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{type(self).__name__}.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class LearnedPositionConfig(LMConfig):
    """Fields shared by the families with learned absolute positions and an LM head."""

    tie_embeddings: bool = True
    """Share the LM head's weight with the token embedding."""
    head_bias: bool = False
    """Give the LM head a bias (the released NRGPT code's untied head has one)."""

    def __post_init__(self):
        super().__post_init__()
        if self.tie_embeddings and self.head_bias:
            raise ValueError(f"{type(self).__name__}.head_bias needs tie_embeddings=False")


class LearnedPositionLM(LanguageModel):
    """Token + learned position embedding -> `trunk` -> final LayerNorm -> LM head.

    Subclasses build their trunk, call `init_weights()` and implement `trunk` and
    `flops_per_token`."""

    def __init__(self, config: LearnedPositionConfig, final_norm_bias: bool = True):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = dropout_module(config.dropout)
        self.ln_f = nn.LayerNorm(config.n_embd, bias=final_norm_bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def init_weights(self, residual_projections: tuple[str, ...] = (), depth: int = 1) -> None:
        """GPT-2 initialisation: N(0, init_std) weights, zero biases; weights whose name ends in
        one of `residual_projections` get init_std / sqrt(2 depth) so that the residual stream's
        variance does not grow with depth."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith(residual_projections):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * depth))

    def embedding_parameters(self) -> list[nn.Parameter]:
        params = [self.wte.weight, self.wpe.weight]
        if not self.config.tie_embeddings:
            params.append(self.lm_head.weight)
        if self.lm_head.bias is not None:
            params.append(self.lm_head.bias)
        return params

    def readout_flops(self, training: bool) -> float:
        """The LM head's matmul (2 D V per token forward, x3 in training)."""
        return (6 if training else 2) * self.config.n_embd * self.config.vocab_size

    def trunk(self, x: torch.Tensor, return_energies: bool,
              cache: DecodeCache | None = None) -> tuple[torch.Tensor, dict]:
        """[B, T, D] embeddings -> ([B, T, D] final state, diagnostics); with a cache, x holds
        the new tokens only (see `common.DecodeCache`)."""
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_energies: bool = False, cache: DecodeCache | None = None) -> ModelOutput:
        start, seq_len = 0 if cache is None else cache.length, idx.size(1)
        if start + seq_len > self.config.block_size:
            raise ValueError(f"sequence length {start + seq_len} exceeds block_size {self.config.block_size}")
        if cache is not None:
            cache.remember(idx)
        positions = torch.arange(start, start + seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        x, diagnostics = self.trunk(x, return_energies, cache)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = cross_entropy(logits, targets)
        return ModelOutput(loss=loss, logits=logits, diagnostics=diagnostics)
