"""Model FLOP/s and MFU. The FLOPs per token of each family come from the model itself
(`model.flops_per_token(seq_len, training=True)`, conventions in the model files: 2 FLOPs per
multiply-accumulate of every matmul the implementation runs, attention over the full context,
inner recurrent/descent loops and EBT's second-order backward included, activation
checkpointing's recomputation not). This module holds the per-device peak table and the
arithmetic around it."""
from __future__ import annotations

from pretrain.config.precision import Precision

PEAK_BF16_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
}
"""Dense (no sparsity) bf16/fp16 tensor-core peak TFLOP/s per device (vendor datasheets, SXM
boards unless named), by a substring of the device name as torch reports it
(`torch.cuda.get_device_name()`, e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3",
"NVIDIA A100-SXM4-80GB"). Longer keys are tried first, so "H100 PCIe" wins over "H100",
"H200" over "H20" and "L40S" over "L40" over "L4"."""


def peak_tflops(device_name: str | None, precision: Precision) -> float | None:
    """Peak dense TFLOP/s of the named device at `precision`; None for CPUs, unknown devices
    and fp32 (its matmuls do not run at the table's rate: an fp32 run has no MFU unless
    `train.peak_tflops` names the peak it should be measured against)."""
    if not device_name or not precision.tensor_cores:
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
