"""Pieces every model family shares: the output type and the base class with the
bookkeeping the trainer relies on (parameter counts, optimizer hints, generation)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelOutput:
    loss: torch.Tensor | None
    """Mean next-token cross entropy over all positions; None when no targets are given."""
    logits: torch.Tensor
    """[B, T, V] next-token logits (for EBT: the final candidate, as log-probabilities)."""
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-d tensors are scalars to log; 1-d tensors hold one value per recurrent/descent step."""


class LanguageModel(nn.Module):
    """Base class of every family. Subclasses set `self.config` and implement `forward`,
    `embedding_parameters` and `flops_per_token`."""

    config: object
    needs_double_backward: bool = False
    """True when forward calls autograd.grad with create_graph, so training backpropagates
    through a gradient: attention must run on kernels with a double backward (not flash), and
    torch.compile is refused."""

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters counted as embeddings (excluded from the non-embedding count)."""
        raise NotImplementedError

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        raise NotImplementedError

    def num_params(self, non_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= sum(p.numel() for p in self.embedding_parameters())
        return total

    def no_weight_decay_names(self) -> set[str]:
        """Names of parameters trained without weight decay: norms, biases, scalars, embeddings."""
        embedding_ids = {id(p) for p in self.embedding_parameters()}
        return {n for n, p in self.named_parameters() if p.ndim < 2 or id(p) in embedding_ids}

    def never_decayed_names(self) -> set[str]:
        """Names of parameters no weight-decay set decays (step sizes such as EBT's alpha)."""
        return set()

    def lr_multipliers(self) -> dict[str, float]:
        """Parameter name -> learning-rate multiplier, for parameters that need their own LR."""
        return {}

    def zero3_leaf_modules(self) -> list[type[nn.Module]]:
        """Module classes DeepSpeed ZeRO-3 must gather whole (e.g. loops that call autograd.grad)."""
        return []

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
        """Sample continuations of idx [B, T0]; the context is cropped to the block size."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self.next_token_logits(context) / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx

    def next_token_logits(self, context: torch.Tensor) -> torch.Tensor:
        """[B, V] logits for the token after `context`; EBT overrides this with its descent."""
        return self(context).logits[:, -1, :]
