"""Model FLOP/s and MFU. The FLOPs per token of each family come from the model itself
(`model.flops_per_token(seq_len, training=True)`, conventions in the model files); this module
holds the per-device peak table and the arithmetic around it."""
from __future__ import annotations

PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "GH200": 989.0,
    "H200": 989.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}
"""Dense (no sparsity) bf16 tensor-core peak TFLOP/s per device, by a substring of the device
name as CUDA reports it (e.g. "NVIDIA H100 80GB HBM3"). Longer names are tried first, so
"H100 PCIe" wins over "H100"."""


def peak_tflops(device_name: str | None) -> float | None:
    """Peak dense bf16 TFLOP/s of the named device; None for CPUs and unknown devices."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


def achieved_tflops(flops_per_token: float, tokens_per_s: float) -> float:
    """Model TFLOP/s actually performed (by all devices together)."""
    return flops_per_token * tokens_per_s / 1e12


def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak."""
    return achieved_tflops(flops_per_token, tokens_per_s) / world_size / peak
