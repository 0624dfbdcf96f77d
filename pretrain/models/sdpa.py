"""Which kernel `F.scaled_dot_product_attention` runs on a CUDA GPU, decided from the shapes
alone, so that a login node (or a CPU test) knows what the GPUs will do.

The rules are torch's dispatcher's (its `sdp_utils.cpp`) for what the models pass: dense
[B, H, T, d] queries, keys and values of one head dim, square causal attention, no mask tensor.
Torch tries the fused kernels first and falls back to its math kernel, which upcasts half
precision to fp32 and materialises the [B, H, T, T] scores (and keeps them for backward): at
T = 1024 that is the dominant memory and time of a step. cuDNN's kernel, which torch prefers on
sm90/sm100 with a recent cuDNN, takes a subset of the shapes flash takes (head dims up to 128 or
256 that are multiples of 8), so "flash" stands for either."""
from __future__ import annotations

import torch

KERNELS = ("flash", "efficient", "math")
"""Torch's default order: flash attention, the memory-efficient (CUTLASS) kernel, the math one."""


def sdpa_kernel(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] = (9, 0),
                training: bool = True, dropout: bool = False) -> str:
    """The kernel torch picks for attention of `head_dim` on queries, keys and values of `dtype`
    (bf16, fp16 or fp32: a run's `Precision.compute_dtype`) on a GPU of compute `capability`
    (H100/H200: (9, 0), A100: (8, 0)), for a step that needs gradients (`training`) and applies
    attention dropout (`dropout`)."""
    half = dtype.itemsize == 2
    if half and (8, 0) <= capability <= (12, 1) and head_dim <= 256:
        # consumer Ampere/Ada/Blackwell: flash's backward lacks head dims in (192, 224], and with
        # dropout those in (224, 256]
        small_smem = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
        if not (training and small_smem and not (head_dim <= 192 or (head_dim > 224 and not dropout))):
            return "flash"
    if capability < (5, 0) or (dtype == torch.bfloat16 and capability < (8, 0)):
        return "math"
    # the memory-efficient kernel's GEMMs need the head dim aligned to 128 bits where tensor
    # cores run them (Ampere on; Volta for half precision), to 4 elements from Ampere on
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = max(4 if capability >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)
    return "efficient" if head_dim % alignment == 0 else "math"
