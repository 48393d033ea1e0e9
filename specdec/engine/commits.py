"""The commit protocol every engine session follows, whatever the engine (docs/protocol.md).

Steps are numbered from 1. A commit for step n says "the committed sequence was ``base_len``
tokens; append ``tokens``". A session applies commits in step order: a commit repeated after it
was applied (a retried RPC) is accepted and changes nothing; a stale one (for a step at or below
the one committed, but not that same commit) or an out-of-order one (assuming another committed
length) is refused with StaleStepError and never applied. A Propose or Verify for a step at or
below the committed one is stale too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import StaleStepError


@dataclass(frozen=True)
class Commit:
    """ "The committed sequence was ``base_len`` tokens; append ``tokens``" for step ``step``.

    ``features`` (for a feature draft only): [len(tokens), H], the target's hidden state before
    each new token. Not part of a commit's identity: a retried commit is the same commit."""

    step: int
    base_len: int
    tokens: tuple[int, ...]
    features: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass
class CommitLedger:
    """Where one session stands in the protocol: the step it committed last, and that commit."""

    session_id: str
    committed_step: int = 0
    last_commit: Commit | None = None

    def check_step(self, step: int) -> None:
        """Refuse a Propose / Verify for a step that is already committed."""
        if step <= self.committed_step:
            raise StaleStepError(
                f"step {step} is stale: session {self.session_id!r} has committed step {self.committed_step}"
            )

    def admits(self, commit: Commit, committed_len: int) -> bool:
        """Whether ``commit`` is to be applied to a session of ``committed_len`` tokens: True for
        the next one, False for a retry of the one applied last; StaleStepError otherwise."""
        if commit.step <= self.committed_step:
            if commit == self.last_commit:
                return False
            raise StaleStepError(
                f"commit for step {commit.step} refused: session {self.session_id!r} already committed "
                f"step {self.committed_step}"
            )
        if commit.base_len != committed_len:
            raise StaleStepError(
                f"commit for step {commit.step} assumes {commit.base_len} committed tokens, session "
                f"{self.session_id!r} has {committed_len}: out of order"
            )
        return True

    def applied(self, commit: Commit) -> None:
        """Record that ``commit`` (admitted) was applied."""
        self.committed_step = commit.step
        self.last_commit = commit
