"""Attention on the meta device as a GPU runs it, for the memory plan (`pretrain.plan`): torch's
own choice there is the unfused math, which keeps the [T, T] attention weights of every head, where
a GPU runs a fused kernel (`models.sdpa` says which). The fused kernels' own buffers, which no
output shows, are counted by op (`kernel_scratch_bytes`), from torch's CUDA sources: CUTLASS's
`mem_eff_attention` and FlashAttention-2."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from pretrain.models.sdpa import sdpa_kernel


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def efficient_forward_scratch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_) -> int:
    """The memory-efficient kernel's forward accumulates its output in a fp32 [B, T, H, d] where it
    runs in 16 bits at a head dim over 128, too wide for its registers (NRGPT's full heads)."""
    B, H, T, d = q.shape
    return 4 * B * T * H * v.size(-1) if q.dtype.itemsize == 2 and max(d, v.size(-1)) > 128 else 0


def efficient_backward_scratch(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               *_) -> int:
    """Its backward's workspace: dQ accumulated in fp32 per 64 x 64 tile of [T, d] (16 bytes of
    lock beside each); in 16 bits at a head dim over 128, dK and dV staged in fp32 for one
    64-key block per key split (torch splits the keys while fewer than 200 (batch, head) blocks
    run); and the fp32 row sums of dO * O."""
    B, H, T, d = q.shape
    tiles = padded(T, 64) * padded(d, 64) // (64 * 64)
    per_head = tiles * (16 + 64 * 64 * 4) + 4 * T
    if q.dtype.itemsize == 2 and max(d, v.size(-1)) > 128:
        splits = max(1, min(padded(k.size(2), 64) // 64, 200 // (B * H)))
        per_head += 4 * splits * 64 * (padded(d, 64) + padded(v.size(-1), 64))
    return B * H * per_head


def flash_backward_scratch(grad_out: torch.Tensor, q: torch.Tensor, *_) -> int:
    """Flash attention's backward (FlashAttention-2 in torch) accumulates dQ in fp32, [B, T, H, d]
    with T rounded up to 128 and d to 32 (to 64 above 128), beside the fp32 row sums of dO * O."""
    B, H, T, d = q.shape
    return 4 * B * H * padded(T, 128) * (padded(d, 32 if d <= 128 else 64) + 1)


KERNEL_SCRATCH = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default: efficient_forward_scratch,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward_scratch,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_backward_scratch,
}
"""The GPU attention kernels' buffers outside their outputs, by op (the CPU's own are a few
per-thread blocks)."""


def kernel_scratch_bytes(func, args) -> int:
    scratch = KERNEL_SCRATCH.get(func)
    return 0 if scratch is None else scratch(*args)


def attention_kernel(compute_dtype: torch.dtype | None) -> Callable:
    """scaled_dot_product_attention as the kernel it takes on a GPU running `compute_dtype`
    (`models.sdpa`), or on the CPU (None): the fused kernels keep their output and one
    log-sum-exp per row for backward; the math one, where a mask or grouped heads leave no
    other, the [T, T] attention weights of every head."""
    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or enable_gqa:
            kernel = "math"
        elif compute_dtype is None:
            kernel = "cpu"
        else:
            kernel = sdpa_kernel(q.size(-1), compute_dtype, dropout=dropout_p > 0)
        aten = torch.ops.aten
        if kernel == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if kernel == "efficient":
            return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                scale=scale)[0]
        return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                       enable_gqa=enable_gqa)[0]

    return attention


@contextlib.contextmanager
def attention_on_meta(compute_dtype: torch.dtype | None):
    """Inside: scaled_dot_product_attention on meta tensors runs `attention_kernel(compute_dtype)`."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", attention_kernel(compute_dtype), "AutogradMeta")
    try:
        yield
    finally:
        library._destroy()
