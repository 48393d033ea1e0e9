"""Sparse draft distributions: q as (token ids, probabilities), what travels on the wire.

The draft may truncate its distribution (keep the top-M tokens and/or the smallest set covering
1 - eps of the mass) and then MUST sample from exactly the truncated, renormalised q it ships:
exactness only needs "y ~ q and the verifier sees the same q"; truncation only costs acceptance
(at most the dropped mass). Tokens outside the support have q = 0 and their target mass is
supplied by the residual.

Conventions:
- The law a ``SparseDist`` denotes is ``probs / probs.sum()`` computed in float64. Both the draft
  (when sampling) and the verifier (when reading q(y)) use that same normalisation, so the float32
  rounding of the shipped values can never make the two sides disagree.
- Sampling is by inverse CDF over the arrays *in their shipped order*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.errors import MalformedProposalError

SUM_TOLERANCE = 1e-4


@dataclass(frozen=True, eq=False)
class SparseDist:
    token_ids: np.ndarray  # int64 [M], unique
    probs: np.ndarray  # float32 [M], finite, >= 0, sums to 1 within SUM_TOLERANCE

    @classmethod
    def of(cls, token_ids: Sequence[int], probs: Sequence[float]) -> SparseDist:
        return cls(np.asarray(token_ids, dtype=np.int64), np.asarray(probs, dtype=np.float32))

    @classmethod
    def one_hot(cls, token: int) -> SparseDist:
        return cls.of([token], [1.0])

    def __len__(self) -> int:
        return len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SparseDist)
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.probs, other.probs)
        )

    __hash__ = None  # type: ignore[assignment]  # equal laws compare by value; numpy arrays do not hash

    def normalised(self) -> np.ndarray:
        """The law this object denotes, float64, aligned with ``token_ids``."""
        p = self.probs.astype(np.float64)
        return p / p.sum()

    def prob(self, token: int) -> float:
        """q(token) under the normalised law; 0.0 outside the support."""
        hits = np.nonzero(self.token_ids == token)[0]
        if len(hits) == 0:
            return 0.0
        return float(self.normalised()[hits[0]])

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        dense = torch.zeros(vocab_size, dtype=torch.float64)
        dense[torch.from_numpy(self.token_ids)] = torch.from_numpy(self.normalised())
        return dense


def validate_sparse(q: SparseDist, proposal: int | None = None, vocab_size: int | None = None) -> None:
    """Raise :class:`MalformedProposalError` unless ``q`` is a usable shipped distribution.

    Checks: same-length arrays, non-empty, ids unique and inside the vocabulary, probabilities
    finite and non-negative, summing to 1 within 1e-4, and the proposal token (if given) inside
    the support with q > 0 -- a token with q = 0 cannot have been sampled from q.
    """
    ids, probs = q.token_ids, q.probs
    if ids.ndim != 1 or probs.ndim != 1 or len(ids) != len(probs):
        raise MalformedProposalError("q", f"token_ids ({len(ids)}) and probs ({len(probs)}) differ in length")
    if len(ids) == 0:
        raise MalformedProposalError("q", "empty distribution")
    if len(np.unique(ids)) != len(ids):
        raise MalformedProposalError("q", "duplicate token ids")
    if (ids < 0).any() or (vocab_size is not None and (ids >= vocab_size).any()):
        raise MalformedProposalError("q", f"token id outside the vocabulary [0, {vocab_size})")
    if not np.isfinite(probs).all():
        raise MalformedProposalError("q", "probabilities must be finite")
    if (probs < 0).any():
        raise MalformedProposalError("q", "probabilities must be non-negative")
    total = float(probs.astype(np.float64).sum())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise MalformedProposalError("q", f"probabilities sum to {total:.6f}, not 1 (tolerance {SUM_TOLERANCE})")
    if proposal is not None:
        hits = np.nonzero(ids == proposal)[0]
        if len(hits) == 0 or probs[hits[0]] <= 0:
            raise MalformedProposalError(
                "q", f"proposed token {proposal} is not in the support of its q (q = 0): it cannot have been sampled"
            )


def _descending_prefix(p: torch.Tensor, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values): the first entries of ``p`` sorted by value descending, ties by lower id --
    all of them when ``top_m`` is 0, else at least the first ``top_m`` (every positive entry
    when fewer are positive).

    With a cap this is a top-k plus a sort of the few candidates instead of a sort of the whole
    vocabulary (49k entries for SmolLM2, once per drafted token). Exactly the
    prefix of the full stable sort: every entry >= the top_m-th largest value is a candidate, so
    ties at the boundary are all present and the stable sort orders them by id.
    """
    if top_m <= 0 or top_m >= p.numel():
        order = torch.sort(p, descending=True, stable=True).indices
        return order, p[order]
    threshold = torch.topk(p, top_m, sorted=False).values.min()
    candidates = torch.nonzero(p >= threshold if threshold > 0 else p > 0).flatten()  # ascending ids
    values = p[candidates]
    order = torch.sort(values, descending=True, stable=True).indices
    return candidates[order], values[order]


def truncate(probs: torch.Tensor, top_m: int = 0, eps: float = 0.0) -> SparseDist:
    """The draft's truncation policy on one dense row of probabilities.

    Keeps the tokens with the largest probability (ties by lower id): at most ``top_m`` of them
    when ``top_m > 0``, and only the smallest set reaching ``1 - eps`` of the mass when
    ``eps > 0``. Zero-probability tokens are always dropped. The kept values are renormalised in
    float64 and shipped as float32, in descending-probability order.
    """
    if probs.ndim != 1:
        raise ValueError("truncate takes one row")
    p = probs.detach().to(torch.float64)
    order, sorted_p = _descending_prefix(p, top_m)
    keep = int((sorted_p > 0).sum())
    if top_m > 0:
        keep = min(keep, top_m)
    if eps > 0.0:
        # The prefix holds every kept candidate, and mass_before only grows along the sort, so
        # counting inside the prefix gives the same answer as counting over the whole row.
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep = min(keep, int((mass_before < 1.0 - eps).sum()))
    keep = max(keep, 1)
    kept = sorted_p[:keep]
    kept = kept / kept.sum()
    return SparseDist(order[:keep].numpy().astype(np.int64), kept.numpy().astype(np.float32))


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """Index i with cdf[i-1] <= u * total < cdf[i] (float64); never an index of weight 0."""
    cdf = np.cumsum(weights, dtype=np.float64)
    total = cdf[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    index = int(np.searchsorted(cdf, u * total, side="right"))
    if index >= len(cdf):  # u * total rounded up to total: take the last token with mass
        index = int(np.nonzero(weights > 0)[0][-1])
    return index


def sample_sparse(q: SparseDist, u: float) -> int:
    """Draw from exactly the shipped q by inverse CDF with the uniform ``u``."""
    return int(q.token_ids[inverse_cdf(q.probs.astype(np.float64), u)])


def sample_dense(probs: torch.Tensor, u: float) -> int:
    """Draw a token id from a dense row (any float dtype, need not be normalised)."""
    return inverse_cdf(probs.detach().to(torch.float64).numpy(), u)
