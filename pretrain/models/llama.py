"""The Llama-style backbone of the EBT paper (pre-RMSNorm, SwiGLU MLP, rotary positions, no
biases) and Transformer++, the plain causal LM on it: the EBT paper's baseline (arXiv 2507.02092
v1, Sec. 4.1 and Table D.2).

`Block` is shared with EBT (`ebt.py`), which runs the same weights over two streams by passing
its own attention function."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.models.blocks import LMConfig, check_positive, cross_entropy, dropout_module, maybe_checkpoint, wide
from pretrain.models.common import DecodeCache, LanguageModel, ModelOutput
from pretrain.models.registry import FamilySpec, register_family, register_flavor

Rope = tuple[torch.Tensor, torch.Tensor]
"""(cos, signed sin), each [T, head_dim]: the rotary tables for T positions (see
`rotary_tables`)."""


@dataclass
class LlamaConfig(LMConfig):
    """Backbone fields shared by Transformer++ and EBT. Their `activation_checkpointing` "step"
    is EBT's descent step; Transformer++ has no steps and treats it as "block"."""

    n_layer: int = 12
    """Number of transformer blocks."""
    mlp_ratio: float = 1.0
    """SwiGLU hidden width as a multiple of D. The released EBT code uses 1 (hidden = D) for EBT
    and for its Transformer++ baseline, which gives the paper's ~126M at 12L/768; Llama uses 8/3."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "n_layer", "mlp_ratio", "rope_theta", "norm_eps")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"{type(self).__name__}.n_head={self.n_head} must divide n_embd="
                             f"{self.n_embd} into an even head size (rotary pairs)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def sdpa_head_dim(self) -> int | None:
        """The head dim of the attention that training runs through SDPA (see `models.sdpa`)."""
        return self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return round(self.mlp_ratio * self.n_embd)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, second_order: bool = False) -> torch.Tensor:
        """`second_order`: the graph will be differentiated twice (EBT's training descent), which
        the hand-written derivatives of `SecondOrderRMSNorm` do in fewer ops than autograd's."""
        if second_order:
            return SecondOrderRMSNorm.apply(x, self.weight, self.eps)[0]
        # torch's kernel accumulates in float32 for bf16 inputs (one kernel per pass on a GPU)
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class SecondOrderRMSNorm(torch.autograd.Function):
    """(y, r): y = x r w with r = 1 / sqrt(mean(x^2) + eps) per row [..., 1], which is not
    differentiable (EBT's first-order energy gradient hands it to `RMSNormGradient`, whose
    derivative w.r.t. x includes r's dependence on x). Its backward is
    `RMSNormGradient`, whose own backward is the second derivative: about 50 ATen ops per call
    through the three passes of a training descent, against about 70 for autograd's graph of
    the composite (on a GPU too: torch's fused backward kernel is only taken without
    create_graph). `aten._fused_rms_norm` is what F.rms_norm runs on a GPU; it also gives r."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.set_materialize_grads(False)  # r's gradient is never formed: no zeros for it
        # r in float32 for bf16 x; the op through torch.ops, which dynamo traces (it skips the
        # private torch._fused_rms_norm binding: a graph break in a compiled EBT)
        y, r = torch.ops.aten._fused_rms_norm(x, [x.size(-1)], weight, eps)
        # r as [..., 1] whatever shape the device's kernel gives it: a flat [rows] would
        # broadcast against the width instead of the rows
        r = r.view(*x.shape[:-1], 1)
        ctx.mark_non_differentiable(r)
        ctx.save_for_backward(x, weight, r)
        return y, r

    @staticmethod
    def backward(ctx, grad_y, _):
        if grad_y is None:
            return None, None, None
        x, weight, r = ctx.saved_tensors
        return (*RMSNormGradient.apply(grad_y, x, weight, r), None)


class RMSNormGradient(torch.autograd.Function):
    """(dx, dw) of y = x r w from dy, in at least float32: with x^ = x r and h = dy w,
    dx = r (h - x^ m), m = mean(h x^), and dw = sum over rows of dy x^. Its backward takes the
    cotangents (a, b) of (dx, dw); third order raises (once_differentiable)."""

    @staticmethod
    def forward(ctx, grad_y, x, weight, r):
        ctx.set_materialize_grads(False)
        g, normed = wide(grad_y), wide(x) * r
        h = g * wide(weight)
        m = (h * normed).mean(-1, keepdim=True)
        dx = r * torch.addcmul(h, normed, m, value=-1)
        dw = (g * normed).sum(tuple(range(x.dim() - 1)))
        ctx.save_for_backward(grad_y, x, weight, r)
        return dx.to(x.dtype), dw.to(weight.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, a, b):
        grad_y, x, weight, r = ctx.saved_tensors
        g, w, normed = wide(grad_y), wide(weight), wide(x) * r
        h = g * w
        m = (h * normed).mean(-1, keepdim=True)
        a = torch.zeros_like(normed) if a is None else wide(a)
        # through h = dy w: t = d<a, dx>/dh
        c = (a * normed).mean(-1, keepdim=True)
        t = r * torch.addcmul(a, c, normed, value=-1)
        d_grad_y, d_weight = t * w, (g * t).sum(tuple(range(x.dim() - 1)))
        # through x, which x^ and r both depend on: p = -d/dx^ (at fixed r), e = d/dr / D
        p = r * torch.addcmul(m * a, c, h)
        if b is not None:
            b = wide(b)
            d_grad_y = torch.addcmul(d_grad_y, b, normed)
            p = torch.addcmul(p, b, g, value=-1)
        e = (a * h).mean(-1, keepdim=True) - c * m
        k = (p * normed).mean(-1, keepdim=True) - e * r
        d_x = r * (normed * k - p)
        return d_grad_y.to(grad_y.dtype), d_x.to(x.dtype), d_weight.to(weight.dtype), None


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Rope:
    """cos and signed sin [len(positions), head_dim] of the rotary angles at `positions`
    (half-split layout: channel c pairs with channel c + head_dim / 2; the sin of the first
    half is negated, see `apply_rotary`). The angles are computed in float32 (float64 for
    float64 models) before casting, so bf16 models keep exact positions."""
    angle_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=angle_dtype) / head_dim)
    angles = positions.to(angle_dtype)[:, None] * inv_freq[None, :]
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


class RotaryCache:
    """`rotary_tables` of positions 0, 1, ... computed once per dtype and device and sliced per
    call: incremental decoding asks for one position per token, and building its tables costs
    more than the rest of a small model's step. Slices are bitwise equal to the tables of the
    positions alone (elementwise ops); the tables grow when a longer range is asked for. A
    compiled graph computes its own tables instead of filling the cache."""

    def __init__(self, head_dim: int, theta: float, n_positions: int):
        self.head_dim, self.theta, self.n_positions = head_dim, theta, n_positions
        self.tables: dict[tuple, Rope] = {}

    def __call__(self, first_position: int, length: int, like: torch.Tensor) -> Rope:
        """Tables [length, head_dim] of positions first_position.. in `like`'s dtype and device."""
        end = first_position + length
        key = (like.dtype, like.device)
        if torch.compiler.is_compiling() and key not in self.tables:
            # Inside the graph: storing the tables would change the cache the graph's guards read
            # and compile every model twice; the graph computes its own and inductor fuses them.
            positions = torch.arange(first_position, end, device=like.device)
            return rotary_tables(positions, self.head_dim, self.theta, like.dtype)
        if key not in self.tables or self.tables[key][0].size(0) < end:
            self.n_positions = max(self.n_positions, end)
            with torch.inference_mode(False):  # ordinary tensors: a later training step saves them
                positions = torch.arange(self.n_positions, device=like.device)
                self.tables[key] = rotary_tables(positions, self.head_dim, self.theta, like.dtype)
        cos, signed_sin = self.tables[key]
        return cos[first_position:end], signed_sin[first_position:end]


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate [B, H, T, head_dim] queries or keys by their positions' angles:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). The half swap is a roll, whose backward is
    another roll (slicing and concatenating halves allocates zero-filled gradients in every
    backward, and the EBT descent runs three)."""
    cos, signed_sin = rope
    return x * cos + torch.roll(x, x.size(-1) // 2, dims=-1) * signed_sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Ordinary causal attention through SDPA (flash / memory-efficient kernels on GPU)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, joined_projections: bool = False):
        super().__init__()
        self.n_head = config.n_head
        self.joined_projections = joined_projections
        D = config.n_embd
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)

    def _rotated(self, h: torch.Tensor, rope: Rope, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
        """h [B, T, D] or [B T, D] through each of `linears`, as heads [B, H, T, head_dim], all
        rotated but the last (the values). Contiguous: the heads' matmuls (EBT's attention runs
        many per call) would otherwise copy the transposed views. With `joined_projections` the
        weights run as one matmul and the heads are transposed and rotated in one call each
        (see `Block`); the values are then copied out, as a view would keep the unrotated heads
        alive until the backward."""
        T, D = rope[0].size(0), h.size(-1)
        H, hd = self.n_head, D // self.n_head
        if not self.joined_projections:
            *rotated, values = (linear(h).view(-1, T, H, hd).transpose(1, 2).contiguous() for linear in linears)
            return (*(apply_rotary(t, rope) for t in rotated), values)
        return self.joined_heads(h, rope, torch.cat([linear.weight for linear in linears]))

    def joined_heads(self, h: torch.Tensor, rope: Rope, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_rotated` with joined projections, given their joined weight [n D, D] (EBT's
        first-order energy gradient reuses it in its backward)."""
        T, D = rope[0].size(0), h.size(-1)
        H, hd = self.n_head, D // self.n_head
        heads = F.linear(h, weight).view(-1, T, weight.size(0) // D, H, hd).permute(2, 0, 3, 1, 4).contiguous()
        return (*apply_rotary(heads[:-1], rope), heads[-1].clone())

    def keys_values(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, H, T, head_dim] of the normalised input h."""
        return self._rotated(h, rope, self.wk, self.wv)

    def forward(self, h: torch.Tensor, rope: Rope, attend: Callable) -> tuple[torch.Tensor, ...]:
        """(output [B, T, D], keys, values): `attend(q, k, v)` mixes the heads."""
        q, k, v = self._rotated(h, rope, self.wq, self.wk, self.wv)
        mixed = attend(q, k, v)
        return self.wo(mixed.transpose(1, 2).reshape(h.shape)), k, v


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig, joined_projections: bool = False):
        super().__init__()
        self.joined_projections = joined_projections
        self.w1 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)  # up
        self.w2 = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.joined_projections:
            gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).chunk(2, -1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """x + Attn(RMSNorm x), then + SwiGLU(RMSNorm x).

    `joined_projections` (EBT): q/k/v, and w1/w3, each run as one matmul of their weights joined
    at call time (same parameters and checkpoints). EBT cannot be compiled and differentiates
    every projection three times per descent step; joined, its S1 step runs 12% fewer ATen ops
    (GEMMs, head transposes, gradient sums), each a launch on a GPU. Transformer++ keeps a
    module call per weight: torch.compile schedules its step, and ZeRO-3 gathers its weights
    module by module."""

    def __init__(self, config: LlamaConfig, joined_projections: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config, joined_projections)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = SwiGLU(config, joined_projections)
        self.dropout = dropout_module(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable = causal_attention,
                second_order: bool = False) -> tuple[torch.Tensor, ...]:
        """(new residual stream, this layer's rotated keys, values); EBT reads the keys and
        values of its observed stream and passes its two-stream attention as `attend`, and
        says when the graph will be differentiated twice (`second_order`, see `RMSNorm`)."""
        mixed, k, v = self.attention(self.attention_norm(x, second_order), rope, attend)
        x = x + self.dropout(mixed)
        x = x + self.dropout(self.feed_forward(self.ffn_norm(x, second_order)))
        return x, k, v


def init_weights(model: nn.Module, config: LlamaConfig) -> None:
    """N(0, init_std) for every linear and embedding weight; the residual output projections
    (attention wo, MLP w2) get init_std / sqrt(2 n_layer) so the stream's variance does not
    grow with depth. RMSNorm gains start at 1."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=config.init_std)
    for name, p in model.named_parameters():
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))


def block_flops(config: LlamaConfig, n_keys: int) -> int:
    """Forward FLOPs per query row of one block: 2 per multiply-accumulate of the attention
    (4 D^2) and SwiGLU (3 D hidden) weight matmuls, plus 4 D n_keys for scores and mixing over
    `n_keys` keys (PaLM convention: the full context, no causal halving)."""
    D = config.n_embd
    return 2 * (4 * D * D + 3 * D * config.mlp_hidden) + 4 * D * n_keys


def check_length(config: LlamaConfig, seq_len: int) -> None:
    if seq_len > config.block_size:
        raise ValueError(f"sequence length {seq_len} exceeds block_size {config.block_size}")


@dataclass
class TransformerPPConfig(LlamaConfig):
    """Transformer++: token embedding -> n_layer Llama blocks -> RMSNorm -> untied LM head."""


class TransformerPP(LanguageModel):
    def __init__(self, config: TransformerPPConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.rope = RotaryCache(config.head_dim, config.rope_theta, config.block_size)
        init_weights(self, config)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_energies: bool = False, cache: DecodeCache | None = None) -> ModelOutput:
        """With a cache, idx holds the new tokens (see `common.DecodeCache`)."""
        start = 0 if cache is None else cache.length
        check_length(self.config, start + idx.size(1))
        if cache is not None:
            cache.remember(idx)
        x = self.tok_embeddings(idx)
        rope = self.rope(start, idx.size(1), x)
        checkpointed = self.config.activation_checkpointing != "off"
        for i, layer in enumerate(self.layers):
            attend = causal_attention if cache is None else cache.slot(i).attend
            x = maybe_checkpoint(checkpointed, layer, x, rope, attend)[0]
        logits = self.output(self.norm(x))
        loss = None
        if targets is not None:
            loss = cross_entropy(logits, targets)
        return ModelOutput(loss=loss, logits=logits)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The input embedding and the untied LM head (the two V x D tables)."""
        return [self.tok_embeddings.weight, self.output.weight]

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """PaLM convention: forward = n_layer x (2 x block weights + 4 D T) + the LM head's 2 D V;
        training = 3 x forward (backward = 2x forward). Norms and elementwise ops are ignored."""
        forward = self.config.n_layer * block_flops(self.config, seq_len)
        forward += 2 * self.config.n_embd * self.config.vocab_size
        return (3 if training else 1) * forward


register_family(FamilySpec("transformer_pp", TransformerPPConfig, TransformerPP, hf_model_type="llama"))

# The EBT paper's "small" Transformer++ baseline: 126.8M with the two V x D tables at V=50304.
register_flavor("transformer_pp-small", TransformerPPConfig())
# CPU sizes for tests, the demo and the scaling sweep (the trainer sets vocab_size from data).
register_flavor("transformer_pp-tiny", TransformerPPConfig(vocab_size=512, block_size=64, n_layer=2,
                                                           n_head=2, n_embd=32))
register_flavor("transformer_pp-mini", TransformerPPConfig(vocab_size=512, block_size=256, n_layer=4,
                                                           n_head=4, n_embd=64))
