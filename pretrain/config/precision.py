"""The training precision: `train.precision` turned, once, into the one record every part of a
run reads (DeepSpeed's JSON, the memory plan, the SDPA kernel, the tensor-core peak, the step's
overflow rule), instead of each of them interpreting the setting's strings.

    precision = resolve_precision(cfg.train.precision, has_gpu=True)
    precision.param_dtype, precision.compute_dtype   # torch.bfloat16, torch.bfloat16

The config imports this module for the setting's type; torch is imported only where a record is
first built, so that reading a config (the scaling tools do, many times) does not load torch."""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

PrecisionSetting = Literal["auto", "fp32", "bf16", "bf16-autocast", "fp16"]
"""The values of `train.precision`: "auto" or the name of one of `precisions()`."""
PRECISION_SETTINGS: tuple[str, ...] = typing.get_args(PrecisionSetting)
"""The same values as a tuple, for checking a setting and naming the choices."""

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
"""The short name of each dtype a precision runs in, by the dtype's own (`str(dtype)`)."""


@dataclass(frozen=True)
class Precision:
    """What a training precision means for each part of a run."""

    name: str
    """The resolved `train.precision` (never "auto"): what the console prints, the memory plan
    reports and checkpoints record."""
    param_dtype: torch.dtype
    """The dtype DeepSpeed casts the module to: its weights, activations and gradients (16-bit
    ones beside fp32 master weights in the optimizer)."""
    compute_dtype: torch.dtype
    """The dtype the forward's matmuls and attention run in: what picks the SDPA kernel and the
    tensor-core peak."""
    autocast: bool
    """The forward runs under torch.autocast in `compute_dtype` (DeepSpeed's torch_autocast),
    the weights staying in `param_dtype`."""
    loss_scaling: bool
    """DeepSpeed scales the loss (fp16's narrow range) and skips, by design, each step whose
    scaled gradients overflow."""

    @property
    def tensor_cores(self) -> bool:
        """The matmuls run at a GPU's 16-bit tensor-core peak (`flops.peak_tflops`); fp32 has none."""
        return self.compute_dtype.itemsize == 2

    @property
    def compute_name(self) -> str:
        """`compute_dtype` by its short name ("bf16" under bf16-autocast too), as messages say it."""
        return DTYPE_NAMES[str(self.compute_dtype)]


@functools.cache
def precisions() -> dict[str, Precision]:
    """The precisions by name: every value of `PrecisionSetting` but "auto"."""
    import torch

    return {p.name: p for p in (
        Precision("fp32", torch.float32, torch.float32, autocast=False, loss_scaling=False),
        # DeepSpeed's bf16 mode: the whole module in bf16
        Precision("bf16", torch.bfloat16, torch.bfloat16, autocast=False, loss_scaling=False),
        # fp32 weights, gradients and optimizer, the forward's matmuls in bf16 under autocast, as
        # the papers' nanoGPT-style code trains
        Precision("bf16-autocast", torch.float32, torch.bfloat16, autocast=True, loss_scaling=False),
        Precision("fp16", torch.float16, torch.float16, autocast=False, loss_scaling=True),
    )}


def resolve_precision(setting: str, has_gpu: bool) -> Precision:
    """The precision `train.precision=setting` (one `validation.validate` accepts) trains in on a
    machine with or without a GPU: "auto" is bf16 on a GPU and fp32 on a CPU."""
    if setting == "auto":
        setting = "bf16" if has_gpu else "fp32"
    return precisions()[setting]
