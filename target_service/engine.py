"""The target engine: per-session KV caches over the large model; verifies a block in ONE pass.

verify() runs one causal pass over [uncached committed tokens (at least the pending token),
y_1..y_k], turns the last k + 1 logit rows into p_1..p_{k+1} with the shared transform pipeline
(penalties position-wise), validates every shipped q, and returns the target side of the
verifier (p_i(y_i), recovered draws, bonus draw). Dense p never leaves this object.
"""
from __future__ import annotations

from typing import Sequence

from specdec.kv import CacheLimits, Commit, SessionEngine, SessionStore
from specdec.sampling import block_token_counts, probs_from_logits
from specdec.sparse import SparseDist
from specdec.verify import TargetVerdict, target_verify, validate_block


class TargetEngine(SessionEngine):
    def __init__(self, model, limits: CacheLimits | None = None, name: str = "target", kv_shards: int = 1):
        super().__init__(SessionStore(model, limits, name=name, kv_shards=kv_shards))

    def target_probs(self, session_id: str, proposals: Sequence[int]):
        """p_1..p_{k+1} for a block (dense; for tests and introspection, not for the wire)."""
        session = self.store.get(session_id)
        with session.lock:
            return self._probs(session, list(proposals))

    def _probs(self, session, proposals: list[int]):
        rows = len(proposals) + 1
        logits = self.store.forward(session, proposals, rows=rows)
        counts = block_token_counts(session.counts, proposals) if session.params.uses_penalties else None
        return probs_from_logits(logits, session.params, counts)

    def verify(self, session_id: str, step: int, proposals: Sequence[int], q_block: Sequence[SparseDist],
               commit: Commit | None = None) -> TargetVerdict:
        session = self.store.get(session_id)
        with session.lock:
            if commit is not None:
                self.store.commit(session, commit)
            self.store.check_step(session, step)
            proposals = [int(t) for t in proposals]
            validate_block(proposals, q_block, self.vocab_size)
            p_rows = self._probs(session, proposals)
            return target_verify(p_rows, proposals, q_block, session.seed, len(session.tokens))
