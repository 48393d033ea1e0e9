"""The exact verifier, split the way the system is (docs/exactness.md, docs/protocol.md).

Target side (:func:`target_verify`): from the dense target rows p_1..p_{k+1} and the shipped
sparse q_1..q_k, return p_i(y_i), a recovered draw r_i ~ normalize(max(0, p_i - q_i)) at every
position, and the bonus draw b ~ p_{k+1}. Dense p never leaves the target.

Coordinator side (:func:`decide`): with its own uniforms u_i, accept y_i while
u_i * q_i(y_i) < p_i(y_i). First rejection at j: emit y_1..y_{j-1}, r_j. All accepted: emit
y_1..y_k, b.

Why pre-drawing r_i everywhere is exact: r_j is drawn with its own key (seed, position,
RECOVERED), independent of the acceptance uniforms, so conditioned on "first rejection at j" it
still has the residual law, and the Leviathan/Chen argument applies position by position.

Greedy (temperature 0) is not a separate algorithm: p and q are one-hot, so acceptance is
"y_i == argmax p_i" and the residual is the one-hot of argmax p_i.

Shapes: k proposals; ``p_rows`` is [k + 1, V]; absolute position of proposal i (0-based) is
``first_position + i`` and of the bonus ``first_position + k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.exact.gumbel import invariant_decision
from specdec.exact.logprobs import RowLogprobs
from specdec.exact.rng import Purpose, uniform
from specdec.exact.sparse import SparseDist, sample_dense, validate_sparse


@dataclass(frozen=True)
class TargetVerdict:
    """What the target returns for one block: O(k) numbers, never a dense row."""

    p_proposed: list[float]  # p_i(y_i), i = 1..k
    recovered: list[int]  # r_i, i = 1..k
    bonus: int  # b ~ p_{k+1}
    # When asked (a feature draft is in use): the target's final hidden states of the k + 1
    # verified positions, [k + 1, H]; row i precedes the token emitted at block index i.
    features: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # When the request asks for logprobs: per row (k + 1), its candidates' log-probabilities and
    # top-n (specdec.exact.logprobs).
    logprobs: list[RowLogprobs] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StepDecision:
    num_accepted: int  # proposals accepted before the first rejection (== k if none)
    tokens: list[int]  # accepted proposals + exactly one recovered-or-bonus token
    rejected_at: int | None = None  # 0-based index of the first rejection, None if all accepted


def residual(p: torch.Tensor, q_dense: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) in float64 (not normalised)."""
    return torch.clamp(p.to(torch.float64) - q_dense.to(torch.float64), min=0.0)


@dataclass(frozen=True)
class EmissionLaw:
    """One position's exact bookkeeping (docs/exactness.md), for a dense target p and draft q."""

    accepted_mass: list[float]  # q(x) * min(1, p(x)/q(x)) = min(p(x), q(x))
    residual_mass: list[float]  # max(0, p(x) - q(x))
    reject_probability: float  # sum of the residual mass
    corrected: list[float] | None  # the residual normalised; None when rejection is impossible

    @property
    def emitted(self) -> list[float]:
        """Accepted mass plus residual mass: equals p, which is the whole point."""
        return [a + r for a, r in zip(self.accepted_mass, self.residual_mass, strict=True)]


def emission_law(p: Sequence[float], q: Sequence[float]) -> EmissionLaw:
    """Where the emitted token's probability comes from. Never divides by q (q may be 0)."""
    if len(p) != len(q):
        raise ValueError("p and q must have the same length")
    accepted = [min(pi, qi) for pi, qi in zip(p, q, strict=True)]
    res = [max(0.0, pi - qi) for pi, qi in zip(p, q, strict=True)]
    total = sum(res)
    corrected = [r / total for r in res] if total > 0 else None
    return EmissionLaw(accepted, res, total, corrected)


def recovered_draw(p: torch.Tensor, q: SparseDist, u: float) -> int:
    """r ~ normalize(max(0, p - q)) with uniform u.

    If the residual has no mass (p <= q everywhere, i.e. p == q up to rounding) a rejection is
    only reachable through float rounding; we then draw from p itself, the law the step must have.
    """
    res = residual(p, q.to_dense(p.shape[-1]))
    if not res.sum() > 0:
        res = p.to(torch.float64)
    return sample_dense(res, u)


def target_verify(
    p_rows: torch.Tensor,
    proposals: Sequence[int],
    q_block: Sequence[SparseDist],
    seed: int,
    first_position: int,
) -> TargetVerdict:
    """Target side of one step. ``q_block`` must already be validated (see ``validate_block``)."""
    k = len(proposals)
    if p_rows.shape[0] != k + 1 or len(q_block) != k:
        raise ValueError(f"need k + 1 = {k + 1} target rows and k q's, got {p_rows.shape[0]} and {len(q_block)}")
    p_proposed = [float(p_rows[i, y]) for i, y in enumerate(proposals)]
    recovered = [
        recovered_draw(p_rows[i], q_block[i], uniform(seed, first_position + i, Purpose.RECOVERED)) for i in range(k)
    ]
    bonus = sample_dense(p_rows[k], uniform(seed, first_position + k, Purpose.BONUS))
    return TargetVerdict(p_proposed, recovered, bonus)


def target_verify_greedy(argmax_rows: Sequence[int], proposals: Sequence[int]) -> TargetVerdict:
    """:func:`target_verify` when every p_i is a one-hot (temperature 0), from the rows' argmaxes.

    p_i(y_i) is 1 or 0; the residual max(0, p_i - q_i) has mass only at argmax p_i whatever q_i is
    (or none, and then the fallback draws from p_i itself: the same token), so the recovered token
    and the bonus are the argmaxes -- no dense row, no uniform needed."""
    k = len(proposals)
    if len(argmax_rows) != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} rows, got {len(argmax_rows)}")
    rows = [int(a) for a in argmax_rows]
    return TargetVerdict(
        [1.0 if int(y) == a else 0.0 for y, a in zip(proposals, rows, strict=False)], rows[:k], rows[k]
    )


def validate_block(
    proposals: Sequence[int], q_block: Sequence[SparseDist], vocab_size: int, invariant: bool = False
) -> None:
    """Every shipped q must be well formed and contain its proposal (docs/exactness.md, "Sparse q").

    ``invariant``: the session samples invariantly, and then a block carries no q at all -- one
    shipped anyway means the draft and the target disagree about the mode, which must not pass
    silently (the target would ignore a q the coordinator's rule then relies on, or the reverse)."""
    from specdec.errors import MalformedProposalError

    for i, y in enumerate(proposals):
        if not 0 <= y < vocab_size:
            raise MalformedProposalError("proposals", f"token {y} at index {i} is outside the vocabulary")
    if invariant:
        if q_block:
            raise MalformedProposalError(
                "q", "the session samples invariantly: its proposals carry no q (the draft is not in invariant mode)"
            )
        return
    if proposals and not q_block:
        raise MalformedProposalError(
            "q", f"{len(proposals)} proposals without q: only an invariant-sampling session ships tokens alone"
        )
    if len(proposals) != len(q_block):
        raise MalformedProposalError("q", f"{len(proposals)} proposals but {len(q_block)} distributions")
    for i, (y, q) in enumerate(zip(proposals, q_block, strict=True)):
        try:
            validate_sparse(q, proposal=y, vocab_size=vocab_size)
        except MalformedProposalError as exc:
            raise MalformedProposalError(f"q[{i}]", str(exc).split(": ", 1)[-1]) from None


def decide(
    proposals: Sequence[int],
    q_proposed: Sequence[float],
    verdict: TargetVerdict,
    seed: int,
    first_position: int,
) -> StepDecision:
    """Coordinator side of one step: the accepted count and the emitted tokens.

    ``q_proposed[i]`` is q_i(y_i) read from the shipped q (> 0 for a valid block).
    """
    for i in range(len(proposals)):
        u = uniform(seed, first_position + i, Purpose.ACCEPT)
        if not u * q_proposed[i] < verdict.p_proposed[i]:
            return StepDecision(i, [*proposals[:i], verdict.recovered[i]], rejected_at=i)
    return StepDecision(len(proposals), [*proposals, verdict.bonus])


def decide_invariant(proposals: Sequence[int], verdict: TargetVerdict) -> StepDecision:
    """Coordinator side of an invariant-sampling step: no uniform, no q. The target's verdict
    for such a block holds its Gumbel-max token x at every position (``recovered``, then
    ``bonus``); proposals stand while they equal x, and the step emits x up to and including the
    first mismatch (specdec.exact.gumbel.invariant_decision)."""
    accepted, tokens = invariant_decision(proposals, [*verdict.recovered, verdict.bonus])
    return StepDecision(accepted, tokens, rejected_at=None if accepted == len(proposals) else accepted)
