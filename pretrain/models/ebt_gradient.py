"""EBT's energy gradient as a first-order graph: the energies E [B, R] of the predicted rows and
their gradient dE/d(embedded candidates) [B, R, D], both from ordinary differentiable operations.

`torch.autograd.grad(E, embedded, create_graph=True)` inside the forward makes the training loss a
second-order graph (autograd differentiates autograd's own backward, op by op, with its views
and reshapes) that torch.compile cannot trace. Here the predicted stream's forward keeps what its
backward reads, and that backward is written out: energy head -> final RMSNorm -> per layer in
reverse the SwiGLU and its norm, the output projection, the two-stream attention's predicted
rows, the rotary rotation (transposed), the joined q/k/v projection and the attention norm. The
observed keys and values are constants for the energy gradient (only the predicted rows move),
but they and every parameter stay ordinary inputs of these operations, so the training backward
(first order) reaches them. Where these operations are custom autograd Functions
(`RMSNormGradient`, `TwoStreamAttentionGrad`), their backward is the hand-written second
derivative that the autograd path runs too.

With activation checkpointing "block", each layer keeps only its input: the forward runs each
layer checkpointed, and each layer's backward is checkpointed together with a recomputation of
its forward, so neither the inner pass nor the training graph holds a layer's activations."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pretrain.models.blocks import wide
from pretrain.models.ebt_attention import default_chunks, two_stream_attention_row_grads, two_stream_attention_weights
from pretrain.models.llama import Block, RMSNorm, RMSNormGradient, Rope, SecondOrderRMSNorm


class Context(NamedTuple):
    """What every layer of one energy evaluation shares."""

    rope: Rope
    """Rotary tables of the predicted rows' positions."""
    offset: int
    """Row r sees observed keys 0..r + offset."""
    chunks: int
    """Row chunks of the two-stream attention."""


class Saved(NamedTuple):
    """One layer's forward values that its backward reads."""

    x: torch.Tensor
    attention_scale: torch.Tensor
    qkv_weight: torch.Tensor
    """The joined projections' weights, once per layer and evaluation (each copy is kept for the
    training backward)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_obs: torch.Tensor
    v_obs: torch.Tensor
    out: torch.Tensor
    probs: list[torch.Tensor]
    mid: torch.Tensor
    ffn_scale: torch.Tensor
    ffn_weight: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    activation: torch.Tensor


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), 1 / rms of each row [N, 1]); the scale is what `RMSNormGradient` reads."""
    return SecondOrderRMSNorm.apply(x, norm.weight, norm.eps)


def rms_norm_backward(norm: RMSNorm, grad_y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return RMSNormGradient.apply(grad_y, x, norm.weight, scale)[0]


def rotary_transposed(grad: torch.Tensor, rope: Rope) -> torch.Tensor:
    """The gradient w.r.t. x of `apply_rotary`(x) = x cos + roll(x, hd/2) sin, given the
    gradient of its result: the roll by half the head is its own inverse."""
    cos, signed_sin = rope
    return grad * cos + torch.roll(grad * signed_sin, grad.size(-1) // 2, dims=-1)


def layer_forward(layer: Block, x: torch.Tensor, k_obs: torch.Tensor, v_obs: torch.Tensor,
                  context: Context) -> tuple[torch.Tensor, Saved]:
    """`Block.forward` of the predicted rows x [B R, D] (no dropout: `EBTConfig` refuses it here)."""
    attention, ffn = layer.attention, layer.feed_forward
    h, attention_scale = rms_norm(layer.attention_norm, x)
    qkv_weight = torch.cat([attention.wq.weight, attention.wk.weight, attention.wv.weight])
    q, k, v = attention.joined_heads(h, context.rope, qkv_weight)
    out, probs = two_stream_attention_weights(q, k, v, k_obs, v_obs, context.offset, context.chunks)
    mid = x + attention.wo(out.transpose(1, 2).reshape(x.shape))
    h, ffn_scale = rms_norm(layer.ffn_norm, mid)
    ffn_weight = torch.cat([ffn.w1.weight, ffn.w3.weight])
    gate, up = F.linear(h, ffn_weight).chunk(2, -1)
    activation = F.silu(gate)
    saved = Saved(x, attention_scale, qkv_weight, q, k, v, k_obs, v_obs, out, probs, mid, ffn_scale, ffn_weight,
                  gate, up, activation)
    return mid + ffn.w2(activation * up), saved


def layer_backward(layer: Block, saved: Saved, grad: torch.Tensor, context: Context) -> torch.Tensor:
    """dE/d(layer input) [B R, D] from dE/d(layer output), the observed keys and values held."""
    attention, ffn = layer.attention, layer.feed_forward
    s = saved
    grad_product = grad @ ffn.w2.weight
    # silu's derivative in at least float32, as autograd's kernel takes it for bf16
    gate = wide(s.gate)
    sigmoid = gate.sigmoid()
    grad_gate = (wide(grad_product * s.up) * sigmoid * (1 + gate * (1 - sigmoid))).to(s.gate.dtype)
    grad_h = torch.cat([grad_gate, grad_product * s.activation], -1) @ s.ffn_weight
    grad = grad + rms_norm_backward(layer.ffn_norm, grad_h, s.mid, s.ffn_scale)
    B, H, R, hd = s.q.shape
    grad_out = (grad @ attention.wo.weight).view(B, R, H, hd).transpose(1, 2)
    grad_q, grad_k, grad_v = two_stream_attention_row_grads(grad_out, s.q, s.k, s.v, s.k_obs, s.v_obs, s.out,
                                                            s.probs, context.offset, context.chunks)
    grad_heads = torch.cat([rotary_transposed(torch.stack([grad_q, grad_k]), context.rope), grad_v[None]])
    grad_projected = grad_heads.permute(1, 3, 0, 2, 4).reshape(B * R, 3 * H * hd)
    grad_h = grad_projected @ s.qkv_weight
    return grad + rms_norm_backward(layer.attention_norm, grad_h, s.x, s.attention_scale)


def recomputed_layer_backward(layer: Block, x: torch.Tensor, grad: torch.Tensor, k_obs: torch.Tensor,
                              v_obs: torch.Tensor, context: Context) -> torch.Tensor:
    """`layer_backward` from the layer's input alone (block checkpointing)."""
    return layer_backward(layer, layer_forward(layer, x, k_obs, v_obs, context)[1], grad, context)


def energy_and_gradient(descent: Any, embedded: torch.Tensor, observed: list,
                        first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E [B, R], dE/d embedded [B, R, D]) of the embedded candidates of positions first_row ..
    first_row + R - 1 (`EnergyDescent.energy`'s values), differentiable where grad is enabled.
    `descent`: the `EnergyDescent` whose parameters score them."""
    cfg = descent.config
    B, R, D = embedded.shape
    context = Context(descent.rope(first_row + 1 + cfg.n_prefix, R, embedded), first_row + cfg.n_prefix,
                      cfg.attention_chunks or default_chunks(embedded.device))
    checkpointed = cfg.activation_checkpointing == "block" and torch.is_grad_enabled()
    x = embedded.flatten(0, 1)  # one [B R, D] matrix, as in `EnergyDescent.energy`
    kept = []
    for layer, (k_obs, v_obs) in zip(descent.layers, observed):
        if checkpointed:
            kept.append(x)
            x = checkpoint(lambda *args: layer_forward(*args)[0], layer, x, k_obs, v_obs, context,
                           use_reentrant=False)
        else:
            x, saved = layer_forward(layer, x, k_obs, v_obs, context)
            kept.append(saved)
    h, scale = rms_norm(descent.norm, x)
    energy = descent.energy_head(h).view(B, R)
    grad = rms_norm_backward(descent.norm, descent.energy_head.weight.expand(x.shape), x, scale)
    for layer, (k_obs, v_obs), saved in zip(reversed(descent.layers), reversed(observed), reversed(kept)):
        if checkpointed:
            grad = checkpoint(recomputed_layer_backward, layer, saved, grad, k_obs, v_obs, context,
                              use_reentrant=False)
        else:
            grad = layer_backward(layer, saved, grad, context)
    return energy, grad.view(B, R, D)
