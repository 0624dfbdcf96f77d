"""The attention of EBT's predicted rows, with hand-written first and second derivatives.

Predicted row r attends to observed keys 0..r + offset and to its own key, in one softmax.
Training differentiates it twice (the energy gradient, then the loss through it), which the
flash and memory-efficient SDPA kernels cannot do, and which autograd of the plain-op form does
with many [rows, keys] temporaries. Two autograd Functions instead:

- `TwoStreamAttention` computes the output and, as extra outputs, the attention weights;
- `TwoStreamAttentionGrad` is its backward, and its own backward is the double backward
  (third order raises: nothing in EBT needs it).

The weights are outputs so that the second-order cotangent of the weights reaches
`TwoStreamAttention`'s backward, which adds it to the first-order one: the score matmuls then
run once per backward pass, as in autograd's graph (12 [rows x keys] matmuls per layer and
step in training, no more). The rows are processed in chunks that skip the observed keys every
row of the chunk masks (the causal blocks above the diagonal), as flash kernels do: 4 chunks
compute 62.5% of the [rows, keys] area. Each chunk costs its own ops, though, and a GPU's step
is bound by its launches, so the number of chunks follows the device (`default_chunks`).

Notation (per batch x head): S = scale q K^T + mask, s = scale q.k (self score), P, p = the
softmax over [S, s], out = P V + p v. For an incoming gradient G of out and Gamma of (P, p):
A = G V^T (+ Gamma), a = G.v, sigma = rowsum (P, p) * (A, a) (= G.out + rowsum (P, p) * Gamma),
and the score gradients are dS = P (A - sigma), ds = p (a - sigma)."""
from __future__ import annotations

import torch

from pretrain.models.blocks import autocast_dtype, no_autocast, wide

CPU_CHUNKS = 4
"""Row chunks on the CPU: more skip more masked keys but run more, smaller matmuls (4 measured
fastest at T=256; 8 and 2 were 2-3% slower per training step)."""


def default_chunks(device: torch.device) -> int:
    """Row chunks on `device`: CPU_CHUNKS on the CPU, where the matmuls' arithmetic dominates;
    one elsewhere. A GPU step is launch-bound (each chunk adds about 120 ATen ops per layer and
    descent step), and one chunk computes the whole [rows, keys] square (1.6x the area of 4
    chunks). The meta device stands for the GPU: `pretrain.plan` measures its memory there."""
    return CPU_CHUNKS if device.type == "cpu" else 1


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1, keepdim=True)


def rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of [B * H, rows, ...]; t itself when that is all of it (one chunk), where a
    slice would still run an ATen op."""
    return t if r0 == 0 and r1 == t.size(1) else t[:, r0:r1]


def keys(t: torch.Tensor, e: int) -> torch.Tensor:
    """The first e observed keys of [B * H, keys, ...] (t itself when those are all)."""
    return t if e == t.size(1) else t[:, :e]


def causal_chunks(n_rows: int, n_keys: int, offset: int, chunks: int) -> list[tuple[int, int, int]]:
    """(first row, end row, visible observed keys) of each of (at most) `chunks` chunks: row r
    sees keys 0..r + offset, so a chunk needs the keys up to its last row's."""
    size = -(-n_rows // chunks)
    spans = []
    for r0 in range(0, n_rows, size):
        r1 = min(n_rows, r0 + size)
        spans.append((r0, r1, min(n_keys, r1 + offset)))
    return spans


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' rows [B * H, rows, ...] as one tensor (one chunk's without a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def key_sum(parts: list[torch.Tensor], n_keys: int) -> torch.Tensor:
    """[B * H, n_keys, hd]: the chunks' gradients [B * H, e, hd] of the e observed keys each
    sees, summed. A later chunk sees at least the keys of an earlier one, so the last holds
    the sum (zero-padded to n_keys if it sees fewer)."""
    *earlier, total = parts
    if total.size(1) < n_keys:
        total = torch.nn.functional.pad(total, (0, 0, 0, n_keys - total.size(1)))
    for part in earlier:
        total[:, :part.size(1)] += part
    return total


def batched(t: torch.Tensor) -> torch.Tensor:
    """[B, H, n, d] as [B * H, n, d] (a view for contiguous heads)."""
    return t.reshape(-1, t.size(-2), t.size(-1))


def gradients_wanted(ctx) -> list[bool]:
    """Per input, whether the running backward pass uses its gradient. The energy gradient is
    taken w.r.t. the candidate only, so there the observed keys' and values' gradients (two
    matmuls per chunk) are skipped. A leaf's accumulator cannot be queried inside
    autograd.grad: assume it is wanted."""
    wanted = []
    for needs, (node, _) in zip(ctx.needs_input_grad, ctx.next_functions):
        leaf = node is not None and node.name().endswith("AccumulateGrad")
        wanted.append(needs and (leaf or torch._C._will_engine_execute_node(node)))
    return wanted


class TwoStreamAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_obs, v_obs, offset, chunks, ask_engine):
        ctx.set_materialize_grads(False)
        ctx.ask_engine = ask_engine
        inputs = (q, k, v, k_obs, v_obs)
        q, k, v, K, V = map(batched, inputs)
        R, T, scale = q.size(1), K.size(1), q.size(2) ** -0.5
        ctx.spans = causal_chunks(R, T, offset, chunks)
        # the scores in at least float32 (bf16 would round them by up to 2^-9 of their size
        # before the softmax), also under autocast
        q_wide, K_wide = wide(q), wide(K)
        # additive mask: row r hides observed keys after r + offset
        hidden = torch.full((R, T), float("-inf"), dtype=q_wide.dtype, device=q.device).triu(offset + 1)
        self_scores = rowdot(q_wide, wide(k)) * scale
        mixed, probs = [], []
        for r0, r1, e in ctx.spans:
            mask = hidden if (r0, r1, e) == (0, R, T) else hidden[r0:r1, :e]
            with no_autocast(q.device):
                observed = torch.baddbmm(mask, rows(q_wide, r0, r1), keys(K_wide, e).transpose(1, 2), alpha=scale)
            # [observed scores | self score], so one softmax covers both (joined by cat, not by
            # matmuls into a slice of one buffer: dynamo does not trace `out=` a strided view)
            weights = torch.cat([observed, rows(self_scores, r0, r1)], -1).softmax(-1)
            mixed.append(torch.bmm(weights[..., :e].to(q.dtype), keys(V, e)))
            probs.append(weights)
        out = torch.addcmul(joined(mixed), self_weights(probs, q.dtype), v).view(inputs[0].shape)
        ctx.save_for_backward(*inputs, out, *probs)
        return (out, *probs)

    @staticmethod
    def backward(ctx, grad_out, *grad_probs):
        q, k, v, k_obs, v_obs, out, *probs = ctx.saved_tensors
        if grad_out is None:
            if all(g is None for g in grad_probs):
                return (None,) * 8
            grad_out = torch.zeros_like(out)
        wanted = gradients_wanted(ctx) if ctx.ask_engine else ctx.needs_input_grad
        grads = TwoStreamAttentionGrad.apply(ctx.spans, wanted[3:5], grad_out, q, k, v, k_obs, v_obs,
                                             out, *grad_probs, *probs)
        return (*grads, None, None, None)


def self_weights(probs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[B * H, R, 1]: each row's weight on its own key (the last column of its chunk)."""
    return joined([p[..., -1:] for p in probs]).to(dtype)


class TwoStreamAttentionGrad(torch.autograd.Function):
    """(dq, dk, dv, dk_obs, dv_obs) from the gradient G of the output and Gamma of the weights;
    the observed keys' and values' gradients are None unless `wanted_obs` says so."""

    @staticmethod
    def forward(ctx, spans, wanted_obs, G, q, k, v, k_obs, v_obs, *out_gammas_and_probs):
        # `out` is taken with the variadic tensors: dynamo, inlining a forward where nothing
        # needs a graph, leaves ctx out when the arguments number the signature's parameters,
        # which one chunk's (one gamma, one weight) would do with `out` as a parameter of its own
        out, *gammas_and_probs = out_gammas_and_probs
        ctx.set_materialize_grads(False)
        shapes = [t.shape for t in (G, q, k, v, k_obs, v_obs, out)]
        G = batched(G).contiguous()
        n = len(gammas_and_probs) // 2
        gammas, probs = gammas_and_probs[:n], gammas_and_probs[n:]
        q_, k_, v_, K, V = map(batched, (q, k, v, k_obs, v_obs))
        T, scale = K.size(1), q_.size(2) ** -0.5
        # A - sigma cancels (G.out is the P-weighted mean of A), so both sides are taken in at
        # least float32 and from the float32 weights: sigma as rowsum(P A), not from the output,
        # which was mixed from weights rounded to the model's dtype
        G_wide, V_wide = wide(G), wide(V)
        a_all = rowdot(G_wide, wide(v_))
        dq_obs, dK_parts, dV_parts, shifted_all, dS_all = [], [], [], [], []
        for (r0, r1, e), P, gamma in zip(spans, probs, gammas):
            G_r = rows(G, r0, r1)
            with no_autocast(q_.device):
                observed = torch.bmm(rows(G_wide, r0, r1), keys(V_wide, e).transpose(1, 2))
            shifted = torch.cat([observed, rows(a_all, r0, r1)], -1)
            sigma = rowdot(P, shifted if gamma is None else shifted + gamma)
            shifted -= sigma
            if gamma is not None:
                shifted += gamma
            dS = (P * shifted).to(q_.dtype)
            dq_obs.append(torch.bmm(dS[..., :e], keys(K, e)))
            if wanted_obs[0]:
                dK_parts.append(torch.bmm(dS[..., :e].transpose(1, 2), rows(q_, r0, r1)))
            if wanted_obs[1]:
                dV_parts.append(torch.bmm(P[..., :e].to(q_.dtype).transpose(1, 2), G_r))
            shifted_all.append(shifted)
            dS_all.append(dS)
        ds = self_weights(dS_all, q_.dtype)
        grads = (torch.addcmul(joined(dq_obs), ds, k_).mul_(scale), q_ * (ds * scale),
                 self_weights(probs, q_.dtype) * G, key_sum(dK_parts, T).mul_(scale) if dK_parts else None,
                 key_sum(dV_parts, T) if dV_parts else None)
        ctx.spans, ctx.shapes, ctx.n = spans, shapes, n
        ctx.third_order = any(gamma is not None for gamma in gammas)
        ctx.save_for_backward(G, q, k, v, k_obs, v_obs, out, *probs, *shifted_all, *dS_all)
        return tuple(None if g is None else g.view(s) for g, s in zip(grads, shapes[1:6]))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv, gK, gV):
        # The second derivatives. Differentiating them again would need the graph of the
        # intermediates saved by `forward`, which has none: third order raises instead of
        # returning wrong numbers (here, or from once_differentiable for the other path).
        if ctx.third_order:
            raise RuntimeError("third-order derivatives of EBT's two-stream attention are not implemented")
        G, *saved = ctx.saved_tensors
        n = ctx.n
        (q, k, v, K, V, out), probs = map(batched, saved[:6]), saved[6:6 + n]
        shifted_all, dS_all = saved[6 + n:6 + 2 * n], saved[6 + 2 * n:]
        gq, gk, gv, gK, gV = (None if g is None else batched(g) for g in (gq, gk, gv, gK, gV))
        T, scale = K.size(1), q.size(2) ** -0.5
        zero = q.new_zeros(())
        # cotangent of the self column of dS (ds), through dq = scale (dS K + ds k), dk = scale ds q
        g_ds = scale * ((rowdot(gq, k) if gq is not None else zero) + (rowdot(gk, q) if gk is not None else zero))
        g_pself = rowdot(gv, G) if gv is not None else zero  # through dv = p G
        g_K_parts, g_V_parts, g_G_obs, g_q_obs, g_sigma, g_a, g_probs = [], [], [], [], [], [], []
        for (r0, r1, e), P, shifted, dS in zip(ctx.spans, probs, shifted_all, dS_all):
            G_r, q_r = rows(G, r0, r1), rows(q, r0, r1)
            g_dS = q.new_zeros(q.size(0), r1 - r0, e + 1)
            if gq is not None:
                g_dS[..., :e].baddbmm_(rows(gq, r0, r1), keys(K, e).transpose(1, 2), alpha=scale)
                g_K_parts.append(torch.bmm(dS[..., :e].transpose(1, 2), rows(gq, r0, r1)))
            if gK is not None:
                g_dS[..., :e].baddbmm_(q_r, keys(gK, e).transpose(1, 2), alpha=scale)
                g_q_obs.append(torch.bmm(dS[..., :e], keys(gK, e)))
            g_dS[..., e:] = rows(g_ds, r0, r1) if g_ds.dim() else 0
            g_dS = g_dS.to(P.dtype)
            # dS = P (A - sigma): cotangents of P (handed to TwoStreamAttention) and of A
            g_P = g_dS * shifted
            g_A_wide = g_dS * P
            g_A = g_A_wide.to(q.dtype)
            g_G_r = torch.bmm(g_A[..., :e], keys(V, e))
            if gv is not None:
                g_P[..., e:] += rows(g_pself, r0, r1)
            if gV is not None:
                g_P[..., :e].baddbmm_(G_r, keys(gV, e).transpose(1, 2))
                g_G_r.baddbmm_(P[..., :e].to(q.dtype), keys(gV, e))
            g_G_obs.append(g_G_r)
            g_V_parts.append(torch.bmm(g_A[..., :e].transpose(1, 2), G_r))
            g_sigma.append(g_A_wide.sum(-1, keepdim=True))  # sigma enters A - sigma negated
            g_a.append(g_A[..., e:])
            g_probs.append(g_P)
        g_sigma, g_a = joined(g_sigma).neg().to(q.dtype), joined(g_a)
        ds = self_weights(dS_all, q.dtype)
        # sigma = G.out, a = G.v, dv = p G
        g_G = joined(g_G_obs).addcmul_(g_sigma, out).addcmul_(g_a, v)
        if gv is not None:
            g_G.addcmul_(self_weights(probs, q.dtype), gv)
        # the [rows, 1] factors are scaled before they broadcast over the head dimension
        g_q = gk * (scale * ds) if gk is not None else torch.zeros_like(q)
        if gK is not None:
            g_q = g_q.add_(joined(g_q_obs), alpha=scale)
        g_k = gq * (scale * ds) if gq is not None else torch.zeros_like(k)
        g_K = key_sum(g_K_parts, T).mul_(scale) if g_K_parts else torch.zeros_like(K)
        grads = (g_G, g_q, g_k, g_a * G, g_K, key_sum(g_V_parts, T), g_sigma * G)
        return (None, None, *(g.view(s) for g, s in zip(grads, ctx.shapes)), *(None,) * n, *g_probs)


def two_stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_obs: torch.Tensor,
                         v_obs: torch.Tensor, offset: int, chunks: int | None = None) -> torch.Tensor:
    """Attention of the predicted rows [B, H, R, hd]: row r attends to observed keys
    0..r + offset and to its own key, in one softmax (scale 1/sqrt(hd)), computed in `chunks`
    row chunks (None: `default_chunks` of the device). Differentiable twice on every device."""
    return two_stream_attention_weights(q, k, v, k_obs, v_obs, offset, chunks, ask_engine=True)[0]


def in_compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The attention's inputs in autocast's dtype under autocast (the scores are still taken in
    at least float32, see `wide`), as they are otherwise."""
    compute = autocast_dtype(tensors[0].device)
    return tensors if compute is None else tuple(t.to(compute) for t in tensors)


def two_stream_attention_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_obs: torch.Tensor,
                                 v_obs: torch.Tensor, offset: int, chunks: int | None = None,
                                 ask_engine: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(`two_stream_attention`'s output, its weights [B * H, rows, visible keys + 1] per row
    chunk), both differentiable: `two_stream_attention_row_grads` reads them. `ask_engine`: the
    backward asks autograd's engine whether the observed keys' and values' gradients are
    wanted (`gradients_wanted`: autograd.grad of the energy skips them), which dynamo cannot
    trace; without it they are computed whenever those inputs require grad, all that the
    first-order energy gradient's only backward, the training one, needs."""
    chunks = chunks or default_chunks(q.device)
    out, *probs = TwoStreamAttention.apply(*in_compute_dtype(q, k, v, k_obs, v_obs), offset, chunks, ask_engine)
    return out, probs


def two_stream_attention_row_grads(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   k_obs: torch.Tensor, v_obs: torch.Tensor, out: torch.Tensor,
                                   probs: list[torch.Tensor], offset: int,
                                   chunks: int | None = None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv): the gradient of <grad_out, out> w.r.t. the predicted rows' queries, keys and
    values, the observed keys and values held constant, from the `two_stream_attention_weights`
    of these inputs. Differentiable (once) w.r.t. everything, the observed keys and values
    included: its backward is `TwoStreamAttentionGrad`'s second derivative."""
    chunks = chunks or default_chunks(q.device)
    spans = causal_chunks(q.size(2), k_obs.size(2), offset, chunks)
    inputs = in_compute_dtype(grad_out, q, k, v, k_obs, v_obs)
    return TwoStreamAttentionGrad.apply(spans, [False, False], *inputs, out, *(None,) * len(probs), *probs)[:3]
