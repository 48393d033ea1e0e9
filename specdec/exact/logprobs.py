"""Log-probabilities of emitted tokens, exactly as the target gives them.

A token's log-probability is read from the target's row for its position in the verify pass of
the step that committed it -- the row the token's law is, whether the token was an accepted
proposal, a recovered draw or the bonus -- so speculation changes nothing in it: a block's row i
is the target-only step's row for that position (same prefix, same transforms).

Which distribution: for sampled requests the transformed one the output is sampled from (after
bias, penalties, temperature, top-k / top-p / min-p; -inf for a token they exclude). For greedy
requests that distribution is a one-hot, which says nothing, so the log-softmax of the logits
after bias and penalties -- the scores the argmax is taken over -- is reported instead.

The target cannot know which of a row's candidates will be emitted (the coordinator decides), so
it answers, per row, the log-probabilities of each candidate (row i < k: the proposal y_i and the
recovered draw r_i; row k: the bonus) and the row's top-n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's bound on top-n


@dataclass(frozen=True)
class RowLogprobs:
    """One verified position: its candidates' log-probabilities and its top-n (most likely
    first, ties toward the lower id)."""

    candidates: dict[int, float]
    top: tuple[tuple[int, float], ...] = ()

    def of(self, token: int) -> float:
        return self.candidates[token]


def row_logprobs(lp_rows: torch.Tensor, candidates: Sequence[Sequence[int]], top_n: int) -> list[RowLogprobs]:
    """Per row of ``lp_rows`` ([rows, V] log-probabilities), the log-probabilities of its
    candidate tokens and its ``top_n`` most likely tokens."""
    if len(candidates) != lp_rows.shape[0]:
        raise ValueError(f"{len(candidates)} candidate lists for {lp_rows.shape[0]} rows")
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    rows = lp_rows.float()
    tops: list[tuple[tuple[int, float], ...]] = [() for _ in range(rows.shape[0])]
    if top_n:
        # stable sort of the negated row: the largest first, equal values by ascending id
        order = torch.sort(-rows, dim=-1, stable=True).indices[:, :top_n]
        values = rows.gather(-1, order)
        tops = [tuple(zip(o.tolist(), v.tolist(), strict=True)) for o, v in zip(order, values, strict=True)]
    return [RowLogprobs({int(t): float(rows[i, int(t)]) for t in candidates[i]}, tops[i]) for i in range(rows.shape[0])]


def block_candidates(proposals: Sequence[int], recovered: Sequence[int], bonus: int) -> list[list[int]]:
    """What a block's row can emit: y_i or r_i for i < k, the bonus at row k."""
    return [[int(y), int(r)] for y, r in zip(proposals, recovered, strict=True)] + [[int(bonus)]]


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and its position's top-n."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def emitted_logprobs(rows: Sequence[RowLogprobs], emitted: Sequence[int]) -> list[TokenLogprob]:
    """The emitted tokens of a step (accepted proposals, then one recovered or bonus token; cut
    short by a stop) with their log-probabilities: token t came from row t."""
    if len(emitted) > len(rows):
        raise ValueError(f"{len(emitted)} tokens emitted from {len(rows)} rows")
    return [TokenLogprob(int(t), rows[i].of(int(t)), rows[i].top) for i, t in enumerate(emitted)]
