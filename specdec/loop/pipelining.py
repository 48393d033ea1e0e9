"""Pipelined drafting: the draft drafts the next block while the target verifies this one
(docs/pipelining.md).

While block y_1..y_k is verified, the draft continues its own chain past it: it draws g at the
bonus position, then z_1..z_m after y_1..y_k, g -- each with the keyed draw of its position, the
draw a serial draft would make there -- and, for rejection branches, drafts after y_1..y_{j-1}
and its guess of the token the target recovers at j. When the verdict's committed tokens are one
branch's prefix, that branch's block is the block the draft would propose now, token for token:
the step sends it to the target with no draft call on its critical path. Otherwise the pre-draft
is dropped and the step drafts as before. Which branch is taken depends on the verdict, but the
block used is the serial block of the prefix that came, so the output (and each seed's tokens)
is the serial run's. How many branches a pre-draft drafts is what fits in a verify
(:class:`BranchBudget`).

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


# Weight of the newest measurement in the running means of a request's branch budget.
BUDGET_DECAY = 0.7
# Steps a request sends no pre-draft after one did not fit, before it measures again.
BUDGET_PROBE_EVERY = 16


@dataclass
class BranchBudget:
    """How much a request's pre-draft may draft: the all-accepted chain and as many rejection
    branches as fit, by the draft's measured seconds per pass, in the time the target takes to
    verify. A pre-draft that outlasts the verdict puts its tail on the critical path (the next
    step waits for it), and a busy draft replica -- shared with other sessions' passes -- is
    slower per pass, so under load a request drafts fewer branches, then none (docs/pipelining.md)."""

    k: int  # the most proposals of a block
    fixed: int | None = None  # rejection branches of every pre-draft, whatever the timing (None: as fit)
    pass_seconds: float | None = None  # the draft's wall seconds per pre-draft pass (running mean)
    verify_seconds: float | None = None  # the target's seconds per verify (running mean)
    skipped: int = 0  # steps without a pre-draft since the last one

    def passes(self, rejections: int) -> int:
        """Draft passes of a pre-draft with ``rejections`` branches (a block of k): the guesses'
        pass, the chain past the block (its bonus guess and k), k per branch."""
        return (1 if rejections else 0) + self.k + 1 + rejections * self.k

    def rejections(self, block: int) -> int | None:
        """Rejection branches for a pre-draft past a block of ``block`` proposals, or None: none
        fits, send no pre-draft (but measure again now and then)."""
        if self.fixed is not None:
            return min(self.fixed, block)
        if self.pass_seconds is None or self.verify_seconds is None:
            return block  # nothing measured yet
        fits = [r for r in range(block + 1) if self.passes(r) * self.pass_seconds <= self.verify_seconds]
        if fits:
            self.skipped = 0
            return fits[-1]
        self.skipped += 1
        if self.skipped >= BUDGET_PROBE_EVERY:
            self.skipped = 0
            return 0
        return None

    def observe(self, rejections: int, predraft_seconds: float, verify_seconds: float) -> None:
        per_pass = predraft_seconds / self.passes(rejections)
        self.pass_seconds = _mean(self.pass_seconds, per_pass)
        self.verify_seconds = _mean(self.verify_seconds, verify_seconds)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else BUDGET_DECAY * new + (1 - BUDGET_DECAY) * old
