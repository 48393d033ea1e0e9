"""The tensor operations the model code shares: matrix products of few rows, RMSNorm, rotary
embeddings and their tables, and the causal mask of a pass over a cached prefix.

Every project model (the lean Llama pass, the heads, the feature draft) computes its products
through :func:`product`, so the fast CPU paths live in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.modeling.fewrow import ROWS as FEW_ROWS
from specdec.modeling.fewrow import few_row_product


def product(x: torch.Tensor, weight: torch.Tensor, twin: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for x [n, in] and weight [out, in], computed as weight @ x^T.

    Why: on the CPU, MKL's product with few rows and a wide output runs far below the memory
    bandwidth on some processors -- and speculation lives on passes of a few rows (measured in
    docs/performance.md). Written as weight @ x^T the long dimension is the weight's, which MKL
    streams at full speed. A single row is computed as two equal columns: the one-column product
    (a matrix-vector kernel) was as slow as ``F.linear``. Same values up to float rounding.

    1-4 rows go to the few-row kernel (``specdec.modeling.fewrow``) where it runs; the MKL forms
    above are the fallback and serve 5 rows or more. ``twin``: the weight's
    :func:`~specdec.modeling.fewrow.lossless_bf16` copy, which the kernel reads instead (same values)."""
    if x.device.type != "cpu" or x.ndim != 2:
        return F.linear(x, weight)
    if x.shape[0] in FEW_ROWS:
        y = few_row_product(x, weight if twin is None else twin)
        if y is not None:
            return y
    return library_product(x, weight)


def library_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`product` without the few-row kernel: the library's product in the weight @ x^T form
    (one row as two equal columns), or ``F.linear`` off the CPU."""
    if x.device.type != "cpu" or x.ndim != 2:
        return F.linear(x, weight)
    if x.shape[0] == 1:
        return torch.mm(weight, torch.cat((x, x)).t())[:, :1].t().contiguous()
    return torch.mm(weight, x.t()).t().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, twin: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`product` for x with any leading dimensions, [..., in] -> [..., out]."""
    return product(x.reshape(-1, x.shape[-1]), weight, twin).view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, module) -> torch.Tensor:
    """The model's RMSNorm ``module`` (Llama's: weight * x / sqrt(mean(x^2) + eps), in float32)
    as one fused op: the module's forward is five tensor operations, and a SmolLM2 pass calls 61."""
    if x.dtype != torch.float32:
        return module(x)
    return torch.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in Llama's rotate-half convention, x [..., T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class RopeTable:
    """cos / sin of the rotary embedding for positions [0, n), computed once by ``compute(size)``
    ([size, D] each) and regrown by doubling (at least 256 rows, at most ``max_length``) when a
    longer sequence arrives, so a decode step only slices."""

    def __init__(self, compute: Callable[[int], tuple[torch.Tensor, torch.Tensor]], max_length: int):
        self.compute = compute
        self.max_length = max_length
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def upto(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables with at least ``length`` rows where the model context allows (possibly more)."""
        if self.cos is None or self.sin is None or self.cos.shape[0] < length:
            current = 0 if self.cos is None else self.cos.shape[0]
            self.cos, self.sin = self.compute(min(self.max_length, max(length, 2 * current, 256)))
        return self.cos, self.sin


def causal_mask(rows: int, start: int, device) -> torch.Tensor | None:
    """Which keys each of ``rows`` new queries may see after ``start`` cached positions: query i
    (position start + i) sees positions <= start + i, [rows, start + rows]. None for one row,
    which sees everything cached."""
    if rows == 1:
        return None
    return torch.ones(rows, start + rows, dtype=torch.bool, device=device).tril_(diagonal=start)
