"""Pipelined drafting: the draft drafts the next block while the target verifies this one
(docs/pipelining.md).

While block y_1..y_k is verified, the draft continues its own chain past it: it draws g at the
bonus position, then z_1..z_m after y_1..y_k, g -- each with the keyed draw of its position, the
draw a serial draft would make there. When the verdict accepts all of y and its bonus token is
g, the committed sequence is exactly the prefix z was drafted from, so z is the block the draft
would propose now, token for token: the step sends it to the target with no draft call on its
critical path. Otherwise the pre-draft is dropped and the step drafts as before. Which branch is
taken depends on the verdict, but the block used is the serial block of the prefix that came,
so the output (and each seed's tokens) is the serial run's.

Pure: the loop (specdec.loop.generate) makes the calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.exact.proposal import DraftProposal


@dataclass(frozen=True)
class PreDraft:
    """A draft's chain past a block under verification: ``drafted`` was proposed after
    ``sequence[:base_len] + assumed`` (its first token is the guess at the bonus position)."""

    base_len: int
    assumed: tuple[int, ...]
    drafted: DraftProposal

    @property
    def branch(self) -> tuple[int, ...]:
        """The tokens this pre-draft assumes the step commits: the block and the guessed bonus."""
        return self.assumed + tuple(self.drafted.tokens[:1])

    def block_for(self, sequence: Sequence[int], k: int) -> DraftProposal | None:
        """The block of up to ``k`` proposals after ``sequence`` (the committed tokens now), or
        None where this pre-draft does not hold it: the sequence is not the branch it assumed,
        or it drafted fewer than the step takes. A shorter block is not a prefix of what a serial
        draft would send (that draft might have gone on), so it is never used."""
        branch = self.branch
        if len(self.drafted) < 2 or len(sequence) != self.base_len + len(branch):
            return None
        if tuple(sequence[self.base_len :]) != branch:
            return None
        rest = DraftProposal(self.drafted.tokens[1:], self.drafted.q[1:])
        if len(rest) < k:
            return None
        return DraftProposal(rest.tokens[:k], rest.q[:k])
