"""The draft's answer to one Propose: the block and, per position, q as shipped."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.exact.sparse import SparseDist

MAX_BLOCK = 64  # the most proposals one step may carry (a draft's k, a target's Verify block)


@dataclass(frozen=True)
class DraftProposal:
    tokens: list[int]
    q: list[SparseDist] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.q):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.q)} distributions")

    def __len__(self) -> int:
        return len(self.tokens)

    def q_of_proposals(self) -> list[float]:
        """q_i(y_i) under the shipped (normalised) law, for the coordinator's decision."""
        return [q.prob(y) for y, q in zip(self.tokens, self.q, strict=True)]
