"""GPT baselines: the GPT-2 style stack (`gpt`) and the recurrent parallel GPT (`gpt_rec`),
where one block with shared weights is applied `n_steps` times (the NRGPT paper's
"GPT_Rec" baseline, arXiv 2512.16762)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.models.blocks import (LearnedPositionConfig, LearnedPositionLM, check_choice, check_positive,
                                    dropout_module, maybe_checkpoint)
from pretrain.models.common import KVSlot
from pretrain.models.registry import FamilySpec, register_family, register_flavor

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


@dataclass
class GPTConfig(LearnedPositionConfig):
    """GPT-2: `n_layer` pre-LayerNorm blocks, tied LM head by default."""

    n_layer: int = 12
    """Number of transformer blocks."""
    mlp_act: str = "gelu"
    """MLP non-linearity: "gelu" (GPT-2) or "relu" (the released NRGPT code's baselines)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms."""
    qkv_bias: bool = True
    """With `bias`, also a bias in the query/key/value projection (the released GPT_Rec has
    none there, while its other layers have one)."""

    @property
    def sdpa_head_dim(self) -> int | None:
        return self.n_embd // self.n_head

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "n_layer")
        check_choice(self, "mlp_act", tuple(ACTIVATIONS))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}")


@dataclass
class GPTRecConfig(GPTConfig):
    """GPT_Rec_parallel: one parallel block (x + Attn(LN1 x) + MLP(LN2 x)) applied `n_steps`
    times with shared weights; untied LM head with bias. `n_layer` must stay 1."""

    n_layer: int = 1
    """Fixed at 1: the one shared block (depth comes from `n_steps`)."""
    n_steps: int = 12
    """How many times the shared block is applied; plays the role of depth."""
    tie_embeddings: bool = False
    head_bias: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "n_steps")
        if self.n_layer != 1:
            raise ValueError(f"GPTRecConfig.n_layer must be 1 (depth is n_steps), got {self.n_layer}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias and config.qkv_bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = dropout_module(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVSlot | None = None) -> torch.Tensor:
        """With a cache, x holds the new tokens, attending to the cached ones too."""
        B, T, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            y = cache.attend(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, D)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = ACTIVATIONS[config.mlp_act]()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = dropout_module(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block; `parallel` adds attention and MLP to the same input (GPT_Rec_parallel)."""

    def __init__(self, config: GPTConfig, parallel: bool = False):
        super().__init__()
        self.parallel = parallel
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVSlot | None = None) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.ln_1(x), cache) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


def block_flops(config: GPTConfig, seq_len: int) -> int:
    """Forward FLOPs per token of one block: 2 per multiply-accumulate of the 12 D^2 weight
    matmuls, plus 4 D T for attention scores and mixing over the full context (PaLM)."""
    D = config.n_embd
    return 2 * 12 * D * D + 4 * D * seq_len


class GPT(LearnedPositionLM):
    def __init__(self, config: GPTConfig):
        super().__init__(config, final_norm_bias=config.bias)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.init_weights(residual_projections=("c_proj.weight",), depth=config.n_layer)

    def trunk(self, x, return_energies=False, cache=None):
        for i, block in enumerate(self.blocks):
            slot = None if cache is None else cache.slot(i)
            x = maybe_checkpoint(self.config.activation_checkpointing != "off", block, x, slot)
        return x, {}

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """PaLM convention: 6 N + 12 L D T for training, where N counts the blocks' weight
        matmuls (= non-embedding parameters up to biases and norms), plus the LM head's 6 D V.
        Forward only is a third of that (backward = 2x forward)."""
        forward = self.config.n_layer * block_flops(self.config, seq_len)
        return (3 if training else 1) * forward + self.readout_flops(training)


class GPTRec(LearnedPositionLM):
    def __init__(self, config: GPTRecConfig):
        super().__init__(config, final_norm_bias=config.bias)
        self.block = Block(config, parallel=True)
        self.init_weights(residual_projections=("c_proj.weight",), depth=config.n_steps)

    def trunk(self, x, return_energies=False, cache=None):
        # "step" and "block" coincide: the one block is the step. Each step attends to its
        # own keys and values, so a decoding cache keeps them per step.
        for step in range(self.config.n_steps):
            slot = None if cache is None else cache.slot(step)
            x = maybe_checkpoint(self.config.activation_checkpointing != "off", self.block, x, slot)
        return x, {}

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """As GPT with the block's cost counted once per step: 3 x S x (24 D^2 + 4 D T) + 6 D V
        in training (backward = 2x forward), a third of the block terms in inference."""
        forward = self.config.n_steps * block_flops(self.config, seq_len)
        return (3 if training else 1) * forward + self.readout_flops(training)


register_family(FamilySpec("gpt", GPTConfig, GPT, hf_model_type="gpt2"))
register_family(FamilySpec("gpt_rec", GPTRecConfig, GPTRec, recurrent=True))

# GPT-2 small; 124.4M parameters at the padded GPT-2 vocabulary.
register_flavor("gpt-124m", GPTConfig())
# Tiny sizes for CPU tests, the demo and the scaling sweep; the trainer sets vocab_size from data.
register_flavor("gpt-tiny", GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32))
register_flavor("gpt-mini", GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=64))
register_flavor("gpt-small", GPTConfig(vocab_size=512, block_size=256, n_layer=6, n_head=4, n_embd=128))

# The released GPT_Rec_parallel baseline uses a ReLU MLP; 85.2M parameters at D=768.
register_flavor("gpt_rec-85m", GPTRecConfig(mlp_act="relu"))
register_flavor("gpt_rec-tiny", GPTRecConfig(vocab_size=512, block_size=64, n_head=2, n_embd=32,
                                             n_steps=3, mlp_act="relu"))
# ListOps: 1 head, 5 steps, 20-token vocabulary; block_size is overridden from the data.
for width in (8, 16, 32, 64, 128, 256):
    register_flavor(f"gpt_rec-listops-w{width}",
                    GPTRecConfig(vocab_size=20, block_size=128, n_head=1, n_embd=width, n_steps=5,
                                 mlp_act="relu"))
