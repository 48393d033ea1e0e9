"""The verifier's target side over many blocks at once: the rows of every session in a pass as
one [rows, V] tensor (issue 43, item 4; docs/batching.md, "Vectorised verification").

A batched pass returns the logits of every session's verify block together. Verifying them one
session at a time ran the transform, p_i(y_i), the residual draws and the bonus draw per session
and per position, in Python and NumPy. Here each of those is one tensor operation over all the
rows of all the blocks: the transform pipeline with per-row parameters
(:func:`specdec.exact.sampling.logprobs_rows`), p_i(y_i) as one gather, the residuals
max(0, p_i - q_i) of every proposal row as one [proposals, V] tensor (each shipped sparse q
scattered into its row), and every draw -- recovered or bonus -- as one inverse-CDF search over
the rows, with the keyed uniforms supplied as a [rows] array.

The draws are the sequential ones' exactly: the same float64 prefix sums (a row's cumulative sum
is computed left to right, as NumPy's is), the same comparison with u * total, the same fallback.
A row's result never depends on the other rows (``tests/test_rows.py`` checks both against the
per-block verifier, :func:`specdec.exact.verify.target_verify`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.exact.rng import Purpose, uniform
from specdec.exact.sparse import SparseDist
from specdec.exact.verify import TargetVerdict


@dataclass(frozen=True)
class BlockRows:
    """One session's block within the rows: its k proposals and their shipped q's, and the key
    of its draws (seed, absolute position of its first proposal)."""

    proposals: Sequence[int]
    q_block: Sequence[SparseDist]
    seed: int
    first_position: int


def inverse_cdf_rows(weights: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Per row of ``weights`` [n, V] (float64, nonnegative, need not be normalised): the index i
    with cdf[i-1] <= u * total < cdf[i] for that row's uniform in ``u`` [n] -- never an index of
    weight 0 (:func:`specdec.exact.sparse.inverse_cdf`, row by row)."""
    if weights.shape[0] == 0:
        return []
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a distribution with no mass")
    index = torch.searchsorted(cdf, (u * total).unsqueeze(-1), right=True).squeeze(-1)
    past = index >= weights.shape[-1]  # u * total rounded up to total: the last token with mass
    if bool(past.any()):
        last = weights.shape[-1] - 1 - torch.argmax(torch.flip(weights > 0, dims=[-1]).to(torch.uint8), dim=-1)
        index = torch.where(past, last, index)
    return index.tolist()


def dense_q_rows(q_rows: Sequence[SparseDist], vocab: int) -> torch.Tensor:
    """The shipped sparse q's as dense float64 rows [len(q_rows), vocab] (each normalised, as
    ``SparseDist.to_dense``), one scatter."""
    dense = torch.zeros(len(q_rows), vocab, dtype=torch.float64)
    if q_rows:
        row_ids = np.concatenate([np.full(len(q.token_ids), i) for i, q in enumerate(q_rows)])
        token_ids = np.concatenate([np.asarray(q.token_ids, dtype=np.int64) for q in q_rows])
        probs = np.concatenate([q.normalised() for q in q_rows])  # the law each denotes (SparseDist.to_dense)
        dense[torch.from_numpy(row_ids), torch.from_numpy(token_ids)] = torch.from_numpy(probs)
    return dense


def verify_rows(p_rows: torch.Tensor, blocks: Sequence[BlockRows]) -> list[TargetVerdict]:
    """The target side of every block at once (:func:`specdec.exact.verify.target_verify` for
    each): ``p_rows`` [sum(k_i + 1), V] holds each block's k_i + 1 target rows, block after
    block, in the order of ``blocks``. Validated q's only (``validate_block``)."""
    sizes = [len(b.proposals) for b in blocks]
    if p_rows.shape[0] != sum(sizes) + len(blocks) or any(
        len(b.q_block) != k for b, k in zip(blocks, sizes, strict=True)
    ):
        raise ValueError("need k + 1 target rows and k q's for every block")
    vocab = p_rows.shape[-1]
    starts = np.cumsum([0, *[k + 1 for k in sizes]])[:-1].tolist()
    proposal_rows = [start + i for start, k in zip(starts, sizes, strict=True) for i in range(k)]
    bonus_rows = [start + k for start, k in zip(starts, sizes, strict=True)]
    tokens = [int(y) for b in blocks for y in b.proposals]
    wide = p_rows.to(torch.float64)
    p_proposed = p_rows[proposal_rows, tokens].tolist() if tokens else []

    proposals_p = wide[proposal_rows]
    residual = torch.clamp(proposals_p - dense_q_rows([q for b in blocks for q in b.q_block], vocab), min=0.0)
    # no residual mass (p <= q everywhere: p == q up to rounding): a rejection is only reachable
    # through rounding, and then the draw is from p itself, the law the step must have
    empty = ~(residual.sum(dim=-1) > 0)
    if bool(empty.any()):
        residual = torch.where(empty.unsqueeze(-1), proposals_p, residual)
    keys = [(b.seed, b.first_position + i) for b in blocks for i in range(len(b.proposals))]
    recovered = inverse_cdf_rows(residual, _uniforms(keys, Purpose.RECOVERED))
    bonus_keys = [(b.seed, b.first_position + len(b.proposals)) for b in blocks]
    bonus = inverse_cdf_rows(wide[bonus_rows], _uniforms(bonus_keys, Purpose.BONUS))

    verdicts, done = [], 0
    for index, k in enumerate(sizes):
        verdicts.append(TargetVerdict(p_proposed[done : done + k], recovered[done : done + k], bonus[index]))
        done += k
    return verdicts


def _uniforms(keys: Sequence[tuple[int, int]], purpose: Purpose) -> torch.Tensor:
    """The keyed uniforms of ``keys`` (seed, position) as a float64 [len(keys)] array."""
    return torch.tensor([uniform(seed, position, purpose) for seed, position in keys], dtype=torch.float64)
