"""Attention of one sequence's new rows over its cached keys and values, two ways: the library's
fused attention (fast, its rounding a function of the shape), and a row-count invariant one (a
row's output the same bits whether it is computed alone or among other rows of its sequence).

Why the second: a verify block of k + 1 rows must give each row the bits a one-row step gives it,
or greedy speculation drifts from the target's own greedy decoding (issue 43, item 6). Fused
attention computes a block with other tiles and other reduction lengths than a single row. Here
every reduction a row takes part in has a length that depends on the row's own position only:

- keys are read in buckets of ``KEY_BLOCK`` positions aligned at 0; a row at position p reads the
  keys of its bucket, [0, (p // KEY_BLOCK + 1) * KEY_BLOCK), the ones after p masked to -inf (so
  they weigh exactly 0) -- a block's rows are split where they cross a bucket boundary;
- the scores are the library's product over the head dimension, the softmax runs per row, and
  the weighted sum of values is a sum, in order, of products over VALUE_CHUNK keys each.

What remains is that the library computes each row of a product the same way whatever the other
rows are; :func:`attention_rows_invariant` checks that on the real shapes when a model loads
(see ``specdec.modeling.invariant`` for the same check of the weight products).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64  # the granularity of the key length a row's reductions run over
VALUE_CHUNK = 512  # the longest reduction of one product (as specdec.modeling.invariant.K_CHUNK)


def fused_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float
) -> torch.Tensor:
    """q [n, Hq, D] at positions [start, start + n); keys/values [Hkv, >= start + n, D] of the
    same sequence (positions past start + n ignored) -> [n, Hq * D], by the library's fused
    attention with grouped-query heads."""
    n, heads, dim = q.shape
    end = start + n
    mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=q.device).tril_(diagonal=start)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys[:, :end].unsqueeze(0),
        values[:, :end].unsqueeze(0),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n, heads * dim)


def invariant_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float
) -> torch.Tensor:
    """:func:`fused_attention`, each row computed over its own key bucket (see the module doc).
    Positions of keys/values past start + n may hold anything finite in ``values`` (a rolled-back
    proposal's, zeros): they are weighed by exactly 0. Where a bucket reaches past the buffer,
    the buffer is padded with zeros for this call."""
    n = q.shape[0]
    out = []
    row = 0
    while row < n:
        position = start + row
        length = (position // KEY_BLOCK + 1) * KEY_BLOCK
        rows = min(n, length - start) - row
        out.append(_bucket_attention(q[row : row + rows], keys, values, position, length, scaling))
        row += rows
    return out[0] if len(out) == 1 else torch.cat(out)


def _bucket_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, length: int, scaling: float
) -> torch.Tensor:
    """Rows q [m, Hq, D] at positions [first, first + m), all within one key bucket of ``length``
    keys -> [m, Hq * D]. In float32 whatever the model's dtype (as fast here as bfloat16 products
    of these shapes, and the scores keep their precision); the weighted sum of values runs over
    VALUE_CHUNK keys at a time, summed in order (a long product's blocking can depend on its row
    count: measured in bfloat16 at 2048 keys)."""
    m, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    keys, values = _padded(keys, length).float(), _padded(values, length).float()
    # the query rows of each key/value head together: [Hkv, m * group, D], row-major by position
    grouped = (q.float() * scaling).view(m, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, m * group, dim)
    scores = torch.matmul(grouped, keys.transpose(1, 2))  # [Hkv, m * group, length]
    positions = torch.arange(first, first + m, device=q.device).repeat_interleave(group)
    hidden = torch.arange(length, device=q.device).unsqueeze(0) > positions.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
    out = None
    for s in range(0, length, VALUE_CHUNK):
        part = torch.matmul(weights[:, :, s : s + VALUE_CHUNK], values[:, s : s + VALUE_CHUNK])
        out = part if out is None else out.add_(part)
    assert out is not None  # [Hkv, m * group, D]
    return out.view(kv_heads, m, group, dim).transpose(0, 1).reshape(m, heads * dim).to(q.dtype)


def _padded(buffer: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of a [H, capacity, D] buffer, zeros past its capacity."""
    if buffer.shape[1] >= length:
        return buffer[:, :length]
    return F.pad(buffer, (0, 0, 0, length - buffer.shape[1]))


def attention_rows_invariant(
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device,
    lengths: tuple[int, ...] = (40, 300, 1100),
    block_rows: int = 9,
    seed: int = 0,
) -> bool:
    """Whether :func:`invariant_attention` gives a block of ``block_rows`` rows ending at each of
    ``lengths`` the bits of the same rows computed one at a time (with the library here)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for end in lengths:
        start = max(0, end - block_rows)
        keys = torch.randn(kv_heads, end, dim, generator=generator).to(dtype=dtype, device=device)
        values = torch.randn(kv_heads, end, dim, generator=generator).to(dtype=dtype, device=device)
        q = torch.randn(end - start, heads, dim, generator=generator).to(dtype=dtype, device=device)
        block = invariant_attention(q, keys, values, start, dim**-0.5)
        for row in range(end - start):
            alone = invariant_attention(q[row : row + 1], keys, values, start + row, dim**-0.5)
            if not torch.equal(alone, block[row : row + 1]):
                return False
    return True
