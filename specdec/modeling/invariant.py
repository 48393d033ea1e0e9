"""Row-count invariant matrix products in torch: a row's result the same bits whatever else is in
the product (issue 43, item 6; docs/batching.md, "Batch invariance").

Why: a library GEMM picks its blocking by shape, so a row of X[:m] @ W^T can round differently
for different m -- a verify block of k + 1 rows then gives other bits than a one-row step, and
greedy speculation drifts from the target's own. Measured on this project's 2-core CPU (MKL,
docs/performance.md): products over a short inner dimension (K <= 576) gave every row the same
bits at every m, in float32 and bfloat16, while the 1536-wide down projection did not (float32
from m = 64, bfloat16 from m = 5). Summing products over fixed K-chunks in a fixed order keeps
each chunk's product in the shape class that measured invariant, so the sum is invariant too.

On an AMD EPYC (Zen 4) the same MKL switches kernels by the row count instead: every product of
1-11 rows rounds unlike the same rows among 12 or more, at every shape. So a product of fewer than
MIN_ROWS rows runs padded with zero rows to MIN_ROWS (a row's sums do not depend on the other rows
of one kernel), which the probe measured invariant there.

That is a property of the machine and its library, not of arithmetic: :func:`rows_invariant`
checks it on the real shapes when a model is loaded, and a path that fails the check is reported
as not invariant rather than assumed to be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.modeling.ops import library_product

K_CHUNK = 512  # the inner dimension of one product (see the module doc)
# A last chunk narrower than this joins the one before it: SmolLM2's 576-wide products then run
# whole (576 measured invariant here too) instead of as 512 + 64, a second product per layer input
# that cost more in calls than it computed.
K_TAIL = K_CHUNK // 4
# The fewest rows a product runs with (fewer are padded with zero rows: see the module doc); a
# few-row product costs about what 16 rows cost on this CPU's memory-bound products anyway.
MIN_ROWS = 16
PROBE_ROWS = (1, 2, 3, 5, 8, 16, 17, 33, 64)  # row counts compared with PROBE_REFERENCE's
PROBE_REFERENCE = 128


class ChunkedLinear:
    """``x @ weight^T`` as products over fixed chunks of the inner dimension, summed in order.
    The chunks are views of the weight (a column slice of a row-major matrix is read with its
    stride, not copied: no memory is duplicated). Always the library's product
    (``ops.library_product``), never the few-row C kernel, whose rounding for 1-4 rows is its own."""

    def __init__(self, weight: torch.Tensor, chunk: int = K_CHUNK):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bounds = chunk_bounds(self.in_features, chunk)
        self.chunks = [weight[:, s:e] for s, e in self.bounds]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> [n, out]."""
        rows = x.shape[0]
        if 0 < rows < MIN_ROWS:  # the library's kernel for a few rows may round otherwise (module doc)
            return self(torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1]))))[:rows]
        if len(self.chunks) == 1:
            return library_product(x, self.chunks[0])
        out = None
        for (s, e), w in zip(self.bounds, self.chunks, strict=True):
            part = library_product(x[:, s:e], w)
            out = part if out is None else out + part
        assert out is not None
        return out


def chunk_bounds(width: int, chunk: int = K_CHUNK) -> list[tuple[int, int]]:
    """[start, end) of each chunk of an inner dimension of ``width``: ``chunk`` wide, a tail
    narrower than a quarter of it joined to the chunk before."""
    bounds = [(s, min(s + chunk, width)) for s in range(0, width, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < chunk // 4:
        bounds[-2:] = [(bounds[-2][0], width)]
    return bounds


def rows_invariant(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    dtype: torch.dtype,
    device,
    rows: Sequence[int] = PROBE_ROWS,
    reference: int = PROBE_REFERENCE,
    seed: int = 0,
) -> bool:
    """Whether ``fn`` (rows [n, in_features] -> rows [n, out]) gives every row the same bits at
    each row count in ``rows`` as among ``reference`` rows, and at any offset in the batch."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(reference, in_features, generator=generator).to(dtype=dtype, device=device)
    full = fn(x)
    for m in rows:
        if m > reference:
            continue
        for offset in (0, reference - m):
            if not torch.equal(fn(x[offset : offset + m].contiguous()), full[offset : offset + m]):
                return False
    return True
