"""The draft's answer to one Propose: the block and, per position, q as shipped.

Invariant sampling (docs/exactness.md) ships no q: the target decides from its own noise, so a
block there is its tokens alone (``q`` empty)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.errors import InvalidArgumentError
from specdec.exact.sparse import SparseDist

MAX_BLOCK = 64  # the most proposals one step may carry (a draft's k, a target's Verify block)


@dataclass(frozen=True)
class DraftProposal:
    tokens: list[int]
    q: list[SparseDist] = field(default_factory=list)
    # A pre-draft's blocks for the verdict's other outcomes (specdec.loop.pipelining): each drafted
    # after the committed tokens and its own prefix, as a serial draft would draft it there.
    branches: tuple[Branch, ...] = ()

    def __post_init__(self) -> None:
        if self.q and len(self.tokens) != len(self.q):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.q)} distributions")

    @property
    def carries_q(self) -> bool:
        """Whether each proposal comes with its q (an empty block counts as either)."""
        return bool(self.q) or not self.tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def q_of_proposals(self) -> list[float]:
        """q_i(y_i) under the shipped (normalised) law, for the coordinator's decision."""
        if not self.carries_q:
            raise ValueError("a block without q (invariant sampling) has no q_i(y_i)")
        return [q.prob(y) for y, q in zip(self.tokens, self.q, strict=True)]


@dataclass(frozen=True)
class Branch:
    """A block drafted ahead for one outcome of a verification under way: after the committed
    tokens and ``prefix`` (the accepted proposals, then the token the target is guessed to draw)."""

    prefix: tuple[int, ...]
    block: DraftProposal


def check_assumed(assumed: Sequence[int], vocab_size: int) -> list[int]:
    """A pre-draft's assumed tokens, validated: ids of the vocabulary, at most a block and its
    bonus token (MAX_BLOCK + 1) of them."""
    tokens = [int(t) for t in assumed]
    if len(tokens) > MAX_BLOCK + 1:
        raise InvalidArgumentError("assumed", f"at most {MAX_BLOCK + 1} tokens, got {len(tokens)}")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise InvalidArgumentError("assumed", "token id outside the vocabulary")
    return tokens
