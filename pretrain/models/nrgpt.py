"""NRGPT: a GPT whose one shared block is a step of gradient descent on an energy ("NRGPT: An Energy-based
Alternative for GPT", arXiv 2512.16762; the method is its Sec. 2). Section, equation and
proposition numbers below are those of the paper's ICLR 2026 version.

Each of `n_steps` applications of the block updates every token A by

    g = Norm(x);   x_A <- x_A - eta (dE_AT(A)/dg_A + s_ff dE_FF(A)/dg_A)

where E(A) is token A's *own* energy, differentiated w.r.t. its own g_A only (the causality
rule). All gradients are closed form, computed in a plain forward pass, so training needs no
double backward; `energy` methods give the energies themselves (monitoring and tests)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.models.blocks import (LearnedPositionConfig, LearnedPositionLM, check_choice, check_positive,
                                    maybe_checkpoint, no_autocast, wide)
from pretrain.models.common import DecodeCache, KVSlot
from pretrain.models.registry import FamilySpec, register_family, register_flavor


@dataclass
class NRGPTConfig(LearnedPositionConfig):
    """NRGPT; the defaults are the released OpenWebText model NRGPT_H_FF2W (90.5M at D=768)."""

    tie_embeddings: bool = False
    head_bias: bool = True
    n_steps: int = 12
    """Number of descent steps (applications of the shared block); plays the role of depth."""
    attention: str = "full"
    """"full": a learned D x D J_h per head, beta=1, alpha_h=1 (released code); "lowrank":
    J_h = W_K^T W_Q with head dim D / n_head, beta = 1/sqrt(head dim), learnable alpha_h."""
    mask: str = "inclusive"
    """Causal key set of token A: "strict" (B < A; ListOps runs) or "inclusive" (B <= A)."""
    grad_mode: str = "reference"
    """"exact": the true gradient of E_AT(A) (adds the self term under the inclusive mask);
    "reference": without the self term, as the released code computes it."""
    attention_impl: str = "sdpa"
    """How the attention term runs: "sdpa" (scaled_dot_product_attention; on GPU the flash or
    cuDNN kernel up to head dim 256, the memory-efficient one beyond it, e.g. for `full` heads
    of head dim D) or "explicit" (scores and softmax from plain matmuls: O(T^2) memory per head,
    cuBLAS speed at any head dim). Exact mode under the inclusive mask is always
    explicit: it needs p_AA, which SDPA does not return."""
    ff_energy: str = "ff2w"
    """Feed-forward energy: "ff1", "ff2" or "ff2w" (the paper's Dense Associative Memory energies)."""
    ff_act: str = "gelu"
    """sigma of the FF energy: "gelu" (exact, erf form) or "relu"."""
    ff_hidden_factor: int = 4
    """Hidden width of the FF energy as a multiple of D."""
    eta: str = "full"
    """Inference rate: "full" (learned D x D), "diag_gamma" (c diag(gamma)) or "scalar" (c I).
    With "diag_gamma" the update provably descends every token's own energy, for a small enough
    c (Proposition 2.1)."""
    eta_init: float = 0.1
    """Initial c = softplus(raw) for eta "diag_gamma" / "scalar"."""
    eta_per_step: bool = False
    """Learn one eta per step (eta(t)) instead of one shared by every step."""
    norm: str = "layernorm"
    """"layernorm" or "rmsnorm"."""
    learnable_gamma: bool = False
    """Learn the norm's scale gamma; the released code freezes it at 1."""
    norm_bias: bool = True
    """Learnable additive bias after the norm (released code: yes)."""
    log_energy: bool = False
    """Always compute per-step energies (otherwise only when forward gets return_energies)."""
    dropout_placement: str = "embeddings"
    """Where `dropout` applies: "embeddings" (the summed token and position embeddings only) or
    "attention" (the released code: each head's attention probabilities and the summed
    attention term, at every step; nothing on the embeddings)."""

    EXECUTION_FIELDS: ClassVar[tuple[str, ...]] = (*LearnedPositionConfig.EXECUTION_FIELDS, "attention_impl",
                                                    "log_energy")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "n_steps", "ff_hidden_factor", "eta_init")
        check_choice(self, "attention", ("full", "lowrank"))
        check_choice(self, "mask", ("strict", "inclusive"))
        check_choice(self, "grad_mode", ("exact", "reference"))
        check_choice(self, "attention_impl", ("sdpa", "explicit"))
        check_choice(self, "ff_energy", ("ff1", "ff2", "ff2w"))
        check_choice(self, "ff_act", ("gelu", "relu"))
        check_choice(self, "eta", ("full", "diag_gamma", "scalar"))
        check_choice(self, "norm", ("layernorm", "rmsnorm"))
        check_choice(self, "dropout_placement", ("embeddings", "attention"))
        if self.attention == "lowrank" and self.n_embd % self.n_head:
            raise ValueError(f"NRGPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd} "
                             "for lowrank attention")

    @property
    def head_dim(self) -> int:
        """Width of a head: D / n_head for `lowrank` heads, D for `full` ones (J_h is D x D)."""
        return self.n_embd // self.n_head if self.attention == "lowrank" else self.n_embd

    @property
    def explicit_scores(self) -> bool:
        """The attention term forms its scores as a tensor instead of through SDPA: on request,
        and for the exact gradient's self term under the inclusive mask (it needs p_AA)."""
        return self.attention_impl == "explicit" or (self.grad_mode == "exact" and self.mask == "inclusive")

    @property
    def sdpa_head_dim(self) -> int | None:
        return None if self.explicit_scores else self.head_dim


def split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    B, T, width = t.shape
    return t.view(B, T, n_head, width // n_head).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    B, H, T, d = t.shape
    return t.transpose(1, 2).reshape(B, T, H * d)


class EnergyAttention(nn.Module):
    """E_AT(A) = -(1/beta) sum_h alpha_h log sum_{B in M(A)} exp(beta q_hA . k_hB), with
    q_h = W_Q,h g and k_h = W_K,h g so that g_B^T J_h g_A = q_hA . k_hB, J_h = W_K,h^T W_Q,h.

    `full` stores the key side only: W_Q,h = I and W_K,h = J_h^T (the rows of `key` for head h
    hold J_h^T). Then dE_AT(A)/dg_A = -sum_h alpha_h W_Q,h^T sum_B p_AB k_hB is ordinary
    attention with values tied to keys, followed by W_Q^T (nothing for `full`); the exact mode's
    self term -sum_h alpha_h p_AA J_h g_A is W_K^T applied to p_AA q_A. Against GPT's attention
    the output projection W_P^T W_V becomes alpha_h eta J_h^T (Eq. 13)."""

    def __init__(self, config: NRGPTConfig):
        super().__init__()
        D, H = config.n_embd, config.n_head
        self.n_head, self.lowrank, self.strict = H, config.attention == "lowrank", config.mask == "strict"
        self.self_term = config.grad_mode == "exact" and not self.strict
        self.explicit = config.explicit_scores
        head_dim = config.head_dim
        self.beta = 1 / math.sqrt(head_dim) if self.lowrank else 1.0
        self.key = nn.Linear(D, H * head_dim, bias=False)
        self.query = nn.Linear(D, H * head_dim, bias=False) if self.lowrank else None
        self.alpha = nn.Parameter(torch.ones(H)) if self.lowrank else None
        self.dropout = config.dropout if config.dropout_placement == "attention" else 0.0

    def project(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, H, T, d] (for `full` g itself, expanded over heads) and keys [B, H, T, d]."""
        k = split_heads(self.key(g), self.n_head)
        q = split_heads(self.query(g), self.n_head) if self.lowrank else g.unsqueeze(1).expand_as(k)
        return q, k

    def key_sets(self, q, k):
        """The strict mask {B < A} is the inclusive causal mask between queries 1..T-1 and keys
        0..T-2; token 0 then has no keys, and `pad_first` gives it a zero row afterwards."""
        return (q[:, :, 1:], k[:, :, :-1]) if self.strict else (q, k)

    def pad_first(self, t: torch.Tensor) -> torch.Tensor:
        if not self.strict:
            return t
        B, H, _, d = t.shape
        return torch.cat([t.new_zeros(B, H, 1, d), t], dim=2)

    def masked_scores(self, q, k) -> torch.Tensor:
        """[B, H, T, T] scores in at least float32: `full` heads (beta 1) have scores of std ~15
        at init, which bf16 would round by up to 1/16, an error of 6% in each attention weight."""
        B, H, T, d = k.shape
        q, k = wide(q), wide(k)
        # the causal mask as an additive -inf bias: its backward passes the gradient through
        # untouched (masked_fill would zero the masked entries again, which the softmax's
        # backward has already made zero), and for lowrank it is fused into the matmul
        future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        with no_autocast(q.device):
            if self.lowrank:
                scores = torch.baddbmm(future, q.reshape(B * H, T, d), k.reshape(B * H, T, d).transpose(1, 2),
                                       alpha=self.beta)
                return scores.view(B, H, T, T)
            # q is g expanded over the heads (beta = 1): one [T, D] x [D, H T] matmul per
            # sequence, instead of a batched matmul that would first copy g for every head
            scores = (q[:, 0] @ k.flatten(1, 2).transpose(1, 2)).unflatten(-1, (H, T)).transpose(1, 2)
        return scores + future

    def weighted(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.alpha is None else t * self.alpha.view(1, -1, 1, 1)

    def energy(self, g: torch.Tensor) -> torch.Tensor:
        """[B, T] per-token E_AT (0 for a token with no keys)."""
        q, k = self.key_sets(*self.project(g))
        lse = torch.logsumexp(self.masked_scores(q, k), dim=-1, keepdim=True)  # [B, H, T', 1]
        return -self.pad_first(self.weighted(lse)).sum(dim=1).squeeze(-1) / self.beta

    def forward(self, g: torch.Tensor, cache: KVSlot | None = None) -> torch.Tensor:
        """[B, T, D] closed-form dE_AT(A)/dg_A for every token A; with a decoding cache, g holds
        the new tokens, whose key sets include the cached tokens (see `mix_cached`)."""
        if cache is not None:
            return self.gradient(*self.mix_cached(g, cache))
        q, k = self.project(g)
        q_seen, k_seen = self.key_sets(q, k)
        dropout = self.dropout if self.training else 0.0
        p_self = None
        if self.explicit:
            # The scores as a tensor: the same FLOPs as attention, O(T^2) memory per head, no
            # fused kernel. (Scores and softmax in float32, the weights mixed in the keys' dtype,
            # as the fused kernels do.)
            p = torch.softmax(self.masked_scores(q_seen, k_seen), dim=-1).to(k_seen.dtype)
            if dropout:
                p = F.dropout(p, dropout)
            mixed, p_self = MixAndSelfWeight.apply(p, k_seen)
        elif q_seen.size(2) == 0:  # strict mask, one token: no keys at all
            mixed = q_seen
        else:
            mixed = F.scaled_dot_product_attention(q_seen, k_seen, k_seen, is_causal=True,
                                                   scale=self.beta, dropout_p=dropout)
        return self.gradient(q, self.pad_first(mixed), p_self, dropout)

    def gradient(self, q: torch.Tensor, mixed: torch.Tensor, p_self: torch.Tensor | None,
                 dropout: float = 0.0) -> torch.Tensor:
        """dE_AT(A)/dg_A [B, T, D] from the queries, the mixed keys sum_B p_AB k_hB [B, H, T, d]
        (zero for a token without keys) and, for the self term, p_AA [B, H, T, 1]; `dropout`
        on the summed attention term (the released placement, in training)."""
        mixed = self.weighted(mixed)
        grad = -(merge_heads(mixed) @ self.query.weight if self.lowrank else mixed.sum(dim=1))
        if self.self_term:
            grad = grad - merge_heads(self.weighted(p_self * q)) @ self.key.weight
        return F.dropout(grad, dropout) if dropout else grad

    def mix_cached(self, g: torch.Tensor, cache: KVSlot) -> tuple[torch.Tensor, ...]:
        """(queries, mixed keys, p_AA or None) of the new tokens g [B, n, D] over the cached
        tokens and themselves, with explicit scores (a few rows: no fused kernel needed).
        Lowrank heads cache their keys W_K g_B. Full heads cache g_B itself, D numbers per token
        instead of the H D of the keys J_h^T g_B: g_A . J_h^T g_B = (J_h g_A) . g_B, and the
        mix sum_B p_AB J_h^T g_B = J_h^T (sum_B p_AB g_B), so J_h moves to the new token's side."""
        B, n, D = g.shape
        first = cache.length
        # the scores and their softmax in at least float32, as `masked_scores`; the weights mix
        # the keys in the keys' dtype
        if self.lowrank:
            q, k = self.project(g)
            (keys,) = cache.append(k)
            with no_autocast(g.device):
                scores = (wide(q) @ wide(keys).transpose(-1, -2)) * self.beta
        else:
            q = g.unsqueeze(1).expand(B, self.n_head, n, D)
            per_head = self.key.weight.view(self.n_head, D, D)  # head h's rows: J_h^T
            (keys,) = cache.append(g.unsqueeze(1))
            with no_autocast(g.device):
                scores = (wide(g).unsqueeze(1) @ wide(per_head)) @ wide(keys).transpose(-1, -2)  # beta = 1
        query_positions = torch.arange(first, first + n, device=g.device)[:, None]
        key_positions = torch.arange(keys.size(2), device=g.device)
        visible = key_positions < query_positions if self.strict else key_positions <= query_positions
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        p = torch.where(visible.any(-1, keepdim=True), p, 0.0).to(keys.dtype)  # strict: token 0 has no keys
        mixed = p @ keys
        if not self.lowrank:
            mixed = mixed @ per_head.transpose(-1, -2)
        p_self = p.gather(-1, query_positions.expand(B, self.n_head, n, 1)) if self.self_term else None
        return q, mixed, p_self


class MixAndSelfWeight(torch.autograd.Function):
    """(p @ k, the diagonal p_AA [.., T, 1]) of attention weights p [.., T, T]. Autograd would
    give the diagonal's gradient as a zero-filled [T, T] tensor added to p's other gradient;
    here it is added into that gradient's diagonal in place."""

    @staticmethod
    def forward(ctx, p, k):
        ctx.save_for_backward(p, k)
        return p @ k, p.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mixed, grad_self):
        p, k = ctx.saved_tensors
        if grad_mixed is None:
            grad_mixed = torch.zeros_like(k)
        grad_p = grad_mixed @ k.transpose(-1, -2)
        if grad_self is not None:
            grad_p.diagonal(dim1=-2, dim2=-1).add_(grad_self.squeeze(-1))
        return grad_p, p.transpose(-1, -2) @ grad_mixed


def normal_cdf_pdf(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.special.ndtr(u), torch.exp(-0.5 * u * u) * (1.0 / math.sqrt(2.0 * math.pi))


class GeluAndSlope(torch.autograd.Function):
    """GELU (exact, erf form) and its derivative Phi(u) + u phi(u) in one pass, with a
    hand-written backward (GELU'' = phi(u) (2 - u^2)) that keeps only u: autograd tracing the
    formula would keep several hD-wide intermediates per step (a third more peak memory).
    Computed in at least float32 and returned in u's dtype: for u < 0 the slope is a difference
    of nearly equal terms, and bf16's Phi (1 + erf) is off by up to 2^-9 in absolute terms."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        u_wide = wide(u)
        cdf, pdf = normal_cdf_pdf(u_wide)
        return (u_wide * cdf).to(u.dtype), (cdf + u_wide * pdf).to(u.dtype)

    @staticmethod
    def backward(ctx, grad_value, grad_slope):
        (u,) = ctx.saved_tensors
        u_wide = wide(u)
        cdf, pdf = normal_cdf_pdf(u_wide)  # recomputed: cheaper than keeping two more [.., hD] tensors
        return (grad_value * (cdf + u_wide * pdf) + grad_slope * pdf * (2.0 - u_wide * u_wide)).to(u.dtype)


def act_and_slope(u: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """sigma(u) and sigma'(u) for the FF energies."""
    if kind == "relu":
        return F.relu(u), (u > 0).to(u.dtype)
    return GeluAndSlope.apply(u)


class EnergyFF(nn.Module):
    """Per-token Dense Associative Memory energies and their closed-form gradients (Sec. 2;
    against GPT's MLP, ff2w's update puts W1 eta^T where the second layer's weight was, Eq. 15).

    ff1:  E = -||sigma(W g + b)||^2
    ff2:  E = -||sigma(W2 sigma(W1 g + b1) + b2)||^2   (W1: D -> D, W2: D -> hD as released)
    ff2w: E = -g . (W2 sigma(W1 g + b1) + b2)          (W1: D -> hD, W2: hD -> D)"""

    def __init__(self, config: NRGPTConfig):
        super().__init__()
        D, hidden = config.n_embd, config.ff_hidden_factor * config.n_embd
        self.kind, self.act = config.ff_energy, config.ff_act
        if self.kind == "ff1":
            self.fc1 = nn.Linear(D, hidden)
        elif self.kind == "ff2":
            self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, hidden)
        else:
            self.fc1, self.fc2 = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def energy(self, g: torch.Tensor) -> torch.Tensor:
        """[B, T] per-token E_FF."""
        hidden, _ = act_and_slope(self.fc1(g), self.act)
        if self.kind == "ff1":
            return -hidden.square().sum(-1)
        if self.kind == "ff2":
            return -act_and_slope(self.fc2(hidden), self.act)[0].square().sum(-1)
        return -(g * self.fc2(hidden)).sum(-1)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        """[B, T, D] closed-form dE_FF/dg."""
        # Constant factors and signs are applied to the D-wide results, not the hD-wide hiddens.
        hidden, slope = act_and_slope(self.fc1(g), self.act)
        if self.kind == "ff1":
            return ((slope * hidden) @ self.fc1.weight) * -2
        if self.kind == "ff2":
            out, out_slope = act_and_slope(self.fc2(hidden), self.act)
            return ((slope * ((out_slope * out) @ self.fc2.weight)) @ self.fc1.weight) * -2
        return -(self.fc2(hidden) + (slope * (g @ self.fc2.weight)) @ self.fc1.weight)


class EnergyNorm(nn.Module):
    """LayerNorm or RMSNorm with gamma learnable or frozen at 1 (then absent) and an optional bias."""

    def __init__(self, config: NRGPTConfig, eps: float = 1e-5):
        super().__init__()
        D = config.n_embd
        self.kind, self.shape, self.eps = config.norm, (D,), eps
        self.weight = nn.Parameter(torch.ones(D)) if config.learnable_gamma else None
        self.bias = nn.Parameter(torch.zeros(D)) if config.norm_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        g = F.rms_norm(x, self.shape, self.weight, self.eps)
        return g if self.bias is None else g + self.bias


class InferenceRate(nn.Module):
    """eta: maps the energy gradient w.r.t. g to the update of x (one per step if requested).

    With eta = c diag(gamma) the update descends each token's energy: the norm's Jacobian is
    dg/dx = diag(gamma) P / sigma with P a symmetric PSD projector, so to first order
    dE = -(c / sigma) (gamma * dE/dg)^T P (gamma * dE/dg) <= 0 (the paper's argument that
    the recurrent step descends the energy)."""

    def __init__(self, config: NRGPTConfig):
        super().__init__()
        self.kind, self.per_step = config.eta, config.eta_per_step
        n_rates, D = (config.n_steps if config.eta_per_step else 1), config.n_embd
        if self.kind == "full":
            self.matrix = nn.Parameter(torch.randn(n_rates, D, D) * config.init_std)
        else:  # c = softplus(raw) > 0
            raw = math.log(math.expm1(config.eta_init))
            self.raw_scale = nn.Parameter(torch.full((n_rates,), raw))

    def forward(self, direction: torch.Tensor, step: int, gamma: torch.Tensor | None) -> torch.Tensor:
        i = step if self.per_step else 0
        if self.kind == "full":
            return direction @ self.matrix[i].T
        step_size = F.softplus(self.raw_scale[i]) * direction
        return step_size * gamma if self.kind == "diag_gamma" and gamma is not None else step_size

    def scale(self) -> torch.Tensor:
        """c averaged over steps, or the mean |eta| entry for a full matrix (for logging)."""
        if self.kind == "full":
            return self.matrix.detach().abs().mean()
        return F.softplus(self.raw_scale.detach()).mean()


class EnergyBlock(nn.Module):
    """The shared block: one descent step on E(A) = E_AT(A) + s_ff E_FF(A) for every token."""

    def __init__(self, config: NRGPTConfig):
        super().__init__()
        self.norm = EnergyNorm(config)
        self.attn = EnergyAttention(config)
        self.ff = EnergyFF(config)
        self.s_ff = nn.Parameter(torch.ones(1))
        self.eta = InferenceRate(config)

    def energy(self, g: torch.Tensor) -> torch.Tensor:
        """[B, T] per-token energies at normalised state g."""
        return self.attn.energy(g) + self.s_ff * self.ff.energy(g)

    def energy_gradient(self, g: torch.Tensor, cache: KVSlot | None = None) -> torch.Tensor:
        """[B, T, D]: row A is dE(A)/dg_A (closed form)."""
        return self.attn(g, cache) + self.s_ff * self.ff(g)

    def forward(self, x: torch.Tensor, step: int, return_energies: bool = False, cache: KVSlot | None = None):
        """(next state, [B, T] energies at x or None); with a decoding cache (this step's), x
        holds the new tokens."""
        g = self.norm(x)
        energy = None
        if return_energies:
            with torch.no_grad():
                energy = self.energy(g)
        return x - self.eta(self.energy_gradient(g, cache), step, self.norm.weight), energy


class Recurrence(nn.Module):
    """The shared block applied n_steps times. One module call per forward: DeepSpeed ZeRO-3
    gathers a leaf module's parameters on entry and reduces their gradients once per call of
    it in backward, so the leaf must be this loop, not the block it calls n_steps times."""

    def __init__(self, config: NRGPTConfig):
        super().__init__()
        self.config = config
        self.block = EnergyBlock(config)

    def forward(self, x: torch.Tensor, return_energies: bool,
                cache: DecodeCache | None = None) -> tuple[torch.Tensor, dict]:
        checkpointed = self.config.activation_checkpointing != "off"
        energies = []
        for step in range(self.config.n_steps):
            # token A's state at step t depends on tokens <= A only: each step's keys are cached
            slot = None if cache is None else cache.slot(step)
            x, energy = maybe_checkpoint(checkpointed, self.block, x, step, return_energies, slot)
            energies.append(energy)
        diagnostics = {"s_ff": self.block.s_ff.detach()[0], "eta_scale": self.block.eta.scale()}
        if return_energies:
            per_token = torch.stack(energies)  # [S, B, T]
            diagnostics["energy"] = per_token.mean(dim=(1, 2))
            diagnostics["_token_energy"] = per_token
        return x, diagnostics


class NRGPT(LearnedPositionLM):
    def __init__(self, config: NRGPTConfig):
        super().__init__(config)
        if config.dropout_placement == "attention":
            self.drop = nn.Identity()  # the released code drops nothing on the embeddings
        self.recurrence = Recurrence(config)
        self.init_weights()

    @property
    def block(self) -> EnergyBlock:
        return self.recurrence.block

    def zero3_leaf_modules(self):
        # The block calls its submodules' energy methods, not only their forward hooks.
        return [Recurrence]

    def trunk(self, x, return_energies=False, cache=None):
        # energies need the attention scores of every token: not computed when decoding
        return self.recurrence(x, (return_energies or self.config.log_energy) and cache is None, cache)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Matmul FLOPs (2 per multiply-accumulate) of one step, times n_steps, plus the LM head.

        Per step and token: attention projections (full: 2 H D^2 for the keys J_h^T g; lowrank:
        2 x 2 H d D for queries and keys + 2 H d D for the W_Q^T back-projection), 4 H d T for
        scores and mixing over the full context (PaLM convention, d = head dim, D for full), the
        exact mode's self term 2 H d D (W_K^T p_AA q), the FF gradient (ff1 16 D^2, ff2 20 D^2,
        ff2w 32 D^2: two matmuls per FF weight, i.e. twice an MLP forward) and eta full 2 D^2.
        Training = 3 x forward (backward = 2x forward); energies for monitoring are not counted."""
        c = self.config
        D, H, hidden = c.n_embd, c.n_head, c.ff_hidden_factor * c.n_embd
        d = c.head_dim
        attention = 2 * H * d * D * (3 if c.attention == "lowrank" else 1) + 4 * H * d * seq_len
        if c.grad_mode == "exact" and c.mask == "inclusive":
            attention += 2 * H * d * D
        ff_weights = {"ff1": hidden * D, "ff2": D * D + hidden * D, "ff2w": 2 * hidden * D}[c.ff_energy]
        step = attention + 4 * ff_weights + (2 * D * D if c.eta == "full" else 0)
        return (3 if training else 1) * c.n_steps * step + self.readout_flops(training)


# its training spikes at learning rates near the best: the spike guard is on by default
register_family(FamilySpec("nrgpt", NRGPTConfig, NRGPT, recurrent=True, step_energies=True, skips_spikes=True))

# The released OWT model (90.5M) and the same structure at 126.1M (D = 1024: the full heads' head
# dim is D, and SDPA's fused kernels need a multiple of 8 in bf16; D = 1020 fell to its math kernel).
register_flavor("nrgpt-ff2w-90m", NRGPTConfig())
register_flavor("nrgpt-ff2w-126m", NRGPTConfig(n_embd=1024))
register_flavor("nrgpt-tiny", NRGPTConfig(vocab_size=512, block_size=64, n_embd=32, n_head=2, n_steps=3))
# Scaling sweep sizes at the widths of gpt-mini / gpt-small.
register_flavor("nrgpt-mini", NRGPTConfig(vocab_size=512, block_size=256, n_embd=64, n_head=4, n_steps=4))
register_flavor("nrgpt-small", NRGPTConfig(vocab_size=512, block_size=256, n_embd=128, n_head=4, n_steps=6))
# ListOps (released runs): 1 full head, 5 steps, strict mask, 20-token vocabulary.
for ff_energy in ("ff1", "ff2w"):
    for width in (8, 16, 32, 64, 128, 256):
        register_flavor(f"nrgpt-{ff_energy}-listops-w{width}",
                        NRGPTConfig(vocab_size=20, block_size=128, n_embd=width, n_head=1,
                                    n_steps=5, mask="strict", ff_energy=ff_energy))
