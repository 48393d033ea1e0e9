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

from specdec.exact.proposal import Branch, DraftProposal


@dataclass(frozen=True)
class PreDraft:
    """A draft's work past a block under verification: ``drafted`` was proposed after
    ``sequence[:base_len] + assumed`` (its first token the guess at the bonus position), with a
    branch for each rejection position it guessed the target's recovered token at."""

    base_len: int
    assumed: tuple[int, ...]
    drafted: DraftProposal

    def branches(self) -> list[Branch]:
        """Every outcome drafted for: all accepted with the guessed bonus, then the rejections."""
        accepted = []
        if self.drafted.tokens:
            rest = DraftProposal(self.drafted.tokens[1:], self.drafted.q[1:])
            accepted.append(Branch((*self.assumed, self.drafted.tokens[0]), rest))
        return accepted + list(self.drafted.branches)

    def block_for(self, sequence: Sequence[int], k: int) -> tuple[DraftProposal, bool] | None:
        """The block of ``k`` proposals after ``sequence`` (the committed tokens now) and whether
        it is a rejection branch's, or None where this pre-draft does not hold it: no branch
        assumed that sequence, or its block is shorter than the step takes (a shorter block is
        not a prefix of what a serial draft would send: that draft might have gone on)."""
        committed = tuple(sequence[self.base_len :])
        if len(sequence) < self.base_len:
            return None
        for branch in self.branches():
            if branch.prefix == committed:
                if len(branch.block) < k:
                    return None
                return DraftProposal(branch.block.tokens[:k], branch.block.q[:k]), len(committed) <= len(self.assumed)
        return None
