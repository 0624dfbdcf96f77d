"""Tolerances for comparing two computations of the same values that may round differently:
another process or thread count, another CPU kernel (torch picks AVX-512, AVX2 or generic code
by host: `ATEN_CPU_CAPABILITY`), another order of the same sums. Their difference is a few units
of the dtype's last place of the values' magnitude, so the tolerance is relative to both;
bit-identity is asserted with `torch.equal` where the code promises it (resume)."""
from __future__ import annotations

import torch


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 64, msg: str | None = None,
                          rounded_in: torch.dtype | None = None) -> None:
    """`actual` equals `expected` up to `ulps` units in the last place, both of each element and
    of the largest magnitude in `expected` (a logit near zero in a row of thousands carries the
    rounding of the thousands). The units are those of `rounded_in`, the dtype in which the two
    sides may first have differed (default: `expected`'s). A real difference (a wrong weight, a
    leaked position) is orders of magnitude larger."""
    eps = torch.finfo(rounded_in or expected.dtype).eps
    scale = expected.detach().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=ulps * eps, atol=ulps * eps * scale, msg=msg)
