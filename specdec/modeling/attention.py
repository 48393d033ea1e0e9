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
  the weighted sum of values is a sum, in order, of products over chunks of VALUE_CHUNK keys.

What remains is that the library computes each row of a product the same way whatever the other
rows are; :func:`attention_rows_invariant` checks that on the real shapes when a model loads
(see ``specdec.modeling.invariant`` for the same check of the weight products).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.modeling.invariant import chunk_bounds
from specdec.modeling.paged import BLOCK, gather_positions, padded_table

# one sequence's part of a paged pass: (its block table, first position of its rows, rows)
Segment = tuple[torch.Tensor, int, int]

KEY_BLOCK = 64  # the granularity of the key length a row's reductions run over
# The fewest query rows one key/value head's products get: with 1 or 2 rows the library takes
# another kernel (measured here in float32: the scores of 1 and 2 rows differ from the same rows
# among more), which a one-row step of a model with 1 or 2 query heads per key/value head hits.
MIN_QUERY_ROWS = 4
VALUE_CHUNK = 512  # keys per product of the weighted sum of values (chunked as invariant.chunk_bounds)


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


def fused_attention_paged(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segments: list[Segment], scaling: float
) -> torch.Tensor:
    """:func:`fused_attention` of each sequence of ``segments`` over its blocks of one layer's
    pool (keys/values [blocks, Hkv, block, D], see :func:`invariant_attention_many`)."""
    attended, row = [], 0
    for table, start, rows in segments:
        end = start + rows
        mine = gather_positions(keys, table, end), gather_positions(values, table, end)
        attended.append(fused_attention(q[row : row + rows], *mine, start, scaling))
        row += rows
    return attended[0] if len(attended) == 1 else torch.cat(attended)


def invariant_attention_many(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segments: list[Segment], scaling: float
) -> torch.Tensor:
    """The attention of the rows of several sequences, q [N, Hq, D], over one layer's paged
    pool, keys/values [blocks, Hkv, block, D] (specdec.modeling.paged): ``segments`` lists, in
    the order of q's rows, each sequence's (block table, start, rows) -- its rows' positions are
    [start, start + rows), their keys/values already in its blocks. -> [N, Hq * D].

    Each row attends over its own key bucket (the module doc). Rows of any sequences whose
    buckets have the same length are computed in one batched product (what makes many decoding
    sequences cheap: one call per bucket length, not per sequence); a row's bits depend on its
    own query, keys and bucket only. Positions past a sequence's rows may hold anything finite (a
    rolled-back proposal's, zeros): they are weighed by exactly 0; a bucket reaching past a
    sequence's blocks reads the pool's null block (zeros)."""
    by_length: dict[int, list[tuple[int, int, int, int]]] = {}  # length -> (segment, row, rows, position)
    row = 0
    for index, (_, start, rows) in enumerate(segments):
        done = 0
        while done < rows:
            position = start + done
            length = (position // KEY_BLOCK + 1) * KEY_BLOCK
            piece = min(rows, length - start) - done
            by_length.setdefault(length, []).append((index, row + done, piece, position))
            done += piece
        row += rows
    n, heads, dim = q.shape
    if len(by_length) == 1 and len(pieces := next(iter(by_length.values()))) == 1:
        return _bucket_attention(q, keys, values, segments, pieces, next(iter(by_length)), scaling)
    out = q.new_empty(n, heads * dim)
    for length, pieces in by_length.items():
        out[_rows_of(pieces, q.device)] = _bucket_attention(q, keys, values, segments, pieces, length, scaling)
    return out


def _rows_of(pieces: list[tuple[int, int, int, int]], device) -> torch.Tensor:
    """The rows of q the pieces cover, in piece order."""
    return torch.cat([torch.arange(row, row + rows, device=device) for _, row, rows, _ in pieces])


def _padded_rows(rows: int, group: int) -> int:
    """Query rows per batch element for ``rows`` rows of ``group`` heads per key/value head: at
    least MIN_QUERY_ROWS products' rows (see there)."""
    return max(rows, -(-MIN_QUERY_ROWS // group))


def _bucket_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    segments: list[Segment],
    pieces: list[tuple[int, int, int, int]],
    length: int,
    scaling: float,
) -> torch.Tensor:
    """The rows of ``pieces`` -- (segment, first row in q, rows, first position), all with a key
    bucket of ``length`` keys -- as one batched product: -> [their rows, Hq * D] in piece order.
    Pieces are padded to the most rows of any (a padding row repeats the piece's last row and is
    dropped), so each piece is one batch element of :func:`_attend`."""
    most = _padded_rows(max(rows for _, _, rows, _ in pieces), q.shape[1] // keys.shape[1])
    # [count, most] rows of q and their positions; a padding row repeats its piece's last one
    offsets = torch.arange(most, device=q.device)
    firsts = torch.tensor([[row, rows, position] for _, row, rows, position in pieces], device=q.device)
    within = torch.minimum(offsets.unsqueeze(0), firsts[:, 1:2] - 1)  # [count, most]
    queries = q[firsts[:, 0:1] + within].float() * scaling  # [count, most, Hq, D]
    count = -(-length // keys.shape[2])
    tables = torch.stack([padded_table(segments[s][0], count) for s, _, _, _ in pieces])  # [pieces, count]
    out = _attend(queries, _bucket(keys, tables, length), _bucket(values, tables, length), firsts[:, 2:3] + within)
    kept = offsets.unsqueeze(0) < firsts[:, 1:2]  # [count, most]: the real rows
    return out[kept].to(q.dtype)


def _bucket(pool: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of each table's blocks of one layer's pool [blocks, Hkv,
    block, D], as float32 [tables, Hkv, length, D]: one gather, one converting copy."""
    pieces, count = tables.shape
    gathered = pool[tables.reshape(-1)].view(pieces, count, *pool.shape[1:])  # [pieces, count, Hkv, block, D]
    _, heads, block, dim = pool.shape
    out = torch.empty(pieces, heads, count, block, dim, dtype=torch.float32, device=pool.device)
    out.copy_(gathered.permute(0, 2, 1, 3, 4))
    return out.view(pieces, heads, count * block, dim)[:, :, :length]


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """queries [count, most, Hq, D] (scaled), keys/values [count, Hkv, length, D], positions
    [count, most] -> [count, most, Hq * D], all float32 whatever the model's dtype (as fast here
    as bfloat16 products of these shapes, and the scores keep their precision). Each row attends
    over the ``length`` keys, those after its position weighed 0; the weighted sum of values runs
    over chunks of VALUE_CHUNK keys, summed in order (a long product's blocking can depend on its
    row count: measured in bfloat16 at 2048 keys)."""
    count, most, heads, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # the query rows of each key/value head together: [count, Hkv, most * group, D], by position
    grouped = (
        queries.view(count, most, kv_heads, group, dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(count, kv_heads, most * group, dim)
    )
    scores = torch.matmul(grouped, keys.transpose(2, 3))  # [count, Hkv, most * group, length]
    hidden = torch.arange(length, device=queries.device) > positions.repeat_interleave(group, dim=1).unsqueeze(2)
    weights = torch.softmax(scores.masked_fill_(hidden.unsqueeze(1), float("-inf")), dim=-1)
    out = None
    for s, e in chunk_bounds(length, VALUE_CHUNK):
        part = torch.matmul(weights[..., s:e], values[:, :, s:e])
        out = part if out is None else out.add_(part)
    assert out is not None  # [count, Hkv, most * group, D]
    return out.view(count, kv_heads, most, group, dim).permute(0, 2, 1, 3, 4).reshape(count, most, heads * dim)


def attention_rows_invariant(
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device,
    lengths: tuple[int, ...] = (40, 300, 1100),
    block_rows: int = 9,
    seed: int = 0,
    block: int = BLOCK,
) -> bool:
    """Whether :func:`invariant_attention_many` gives a block of ``block_rows`` rows ending at each
    of ``lengths``, computed among the other blocks, the bits of the same rows computed one at a
    time (with the library here), the sequences' blocks scattered over a pool of ``block``
    positions per block."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-end // block) for end in lengths]
    ids = (torch.randperm(sum(blocks), generator=generator) + 1).tolist()  # block 0: the null block
    shape = (sum(blocks) + 1, kv_heads, block, dim)
    keys = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
    values = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
    keys[0], values[0] = 0, 0
    segments: list[Segment] = []
    queries = []
    for end, count in zip(lengths, blocks, strict=True):
        start = max(0, end - block_rows)
        table = torch.tensor(ids[:count], dtype=torch.long, device=device)
        del ids[:count]
        queries.append(torch.randn(end - start, heads, dim, generator=generator).to(dtype=dtype, device=device))
        segments.append((table, start, end - start))
    together = invariant_attention_many(torch.cat(queries), keys, values, segments, dim**-0.5)
    row = 0
    for q, (table, start, rows) in zip(queries, segments, strict=True):
        for i in range(rows):
            alone = invariant_attention_many(q[i : i + 1], keys, values, [(table, start + i, 1)], dim**-0.5)
            if not torch.equal(alone, together[row + i : row + i + 1]):
                return False
        row += rows
    return True
