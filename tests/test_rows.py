"""The target side of many blocks at once (specdec/exact/rows.py) against the per-block verifier:
the same p_i(y_i), recovered and bonus draws, bit for bit, whatever other blocks share the rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.exact.rng import Purpose, uniform
from specdec.exact.rows import BlockRows, inverse_cdf_rows, verify_rows
from specdec.exact.sparse import SparseDist, inverse_cdf, truncate
from specdec.exact.verify import target_verify

VOCAB = 50


def random_block(rng: random.Random, generator: torch.Generator, k: int) -> tuple[torch.Tensor, BlockRows]:
    """k + 1 target rows (some peaked, some with zeros) and k proposals with shipped q's of the
    kinds a draft sends: truncated rows, one-hots, and q equal to p (no residual mass)."""
    logits = torch.randn(k + 1, VOCAB, generator=generator) * rng.choice([0.5, 3.0])
    if rng.random() < 0.5:
        logits[:, rng.randrange(VOCAB) :] = -float("inf")  # a tail of impossible tokens
        logits[:, 0] = 0.0
    p = torch.softmax(logits, dim=-1)
    proposals, qs = [], []
    for i in range(k):
        kind = rng.randrange(3)
        if kind == 0:
            q = truncate(torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1), 8, 1e-4)
        elif kind == 1:
            q = SparseDist.one_hot(rng.randrange(VOCAB))
        else:
            q = truncate(p[i], 0, 0.0)
        qs.append(q)
        proposals.append(int(q.token_ids[rng.randrange(len(q))]))
    return p, BlockRows(proposals, qs, seed=rng.randrange(1 << 62), first_position=rng.randrange(1000))


@pytest.mark.parametrize("seed", range(4))
def test_many_blocks_at_once_give_each_blocks_own_verdict_bit_for_bit(seed):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    blocks = [random_block(rng, generator, rng.randrange(0, 7)) for _ in range(12)]
    together = verify_rows(torch.cat([p for p, _ in blocks]), [b for _, b in blocks])
    for (p, block), verdict in zip(blocks, together, strict=True):
        alone = target_verify(p, block.proposals, block.q_block, block.seed, block.first_position)
        assert verdict == alone
        assert verify_rows(p, [block]) == [alone]  # and a block alone in the rows


def test_inverse_cdf_rows_is_the_sequential_search_row_by_row_edges_included():
    rng = np.random.default_rng(3)
    weights = rng.random((40, 30))
    weights[::3, 20:] = 0.0  # trailing zeros: u * total rounding up must not land on one
    weights[5] = 0.0
    weights[5, 7] = 1e-300
    us = np.concatenate([rng.random(36), [0.0, 1.0 - 2.0**-53, 1.0 - 2.0**-53, 0.5]])
    got = inverse_cdf_rows(torch.from_numpy(weights), torch.from_numpy(us))
    assert got == [inverse_cdf(w, float(u)) for w, u in zip(weights, us, strict=True)]
    assert all(weights[i, index] > 0 for i, index in enumerate(got))
    with pytest.raises(ValueError, match="no mass"):
        inverse_cdf_rows(torch.zeros(2, 4, dtype=torch.float64), torch.tensor([0.1, 0.2], dtype=torch.float64))


def test_the_uniforms_are_the_keyed_ones():
    """A bonus row that is a one-hot never moves; a flat one draws what its key's uniform picks."""
    flat = torch.full((1, 8), 1 / 8)
    (verdict,) = verify_rows(flat, [BlockRows([], [], seed=11, first_position=5)])
    assert verdict.bonus == int(uniform(11, 5, Purpose.BONUS) * 8)
