"""The draft engine: per-session KV caches over a small causal LM; proposes blocks with sparse q.

Proposal y_i is sampled from the transformed, truncated q_i it ships (same transform pipeline as
the target, penalties seeing the proposals before i), with the uniform keyed by
(seed, absolute position, DRAFT).
"""
from __future__ import annotations

from specdec.kv import CacheLimits, Commit, SessionEngine, SessionStore
from specdec.proposal import DraftProposal
from specdec.rng import Purpose, uniform
from specdec.sampling import probs_from_logits
from specdec.sparse import sample_sparse, truncate


class DraftEngine(SessionEngine):
    kind = "model"

    def __init__(self, model, limits: CacheLimits | None = None, top_m: int = 64, eps: float = 1e-4,
                 name: str = "draft"):
        """``top_m`` / ``eps``: the truncation policy of shipped q (0 turns either off). The
        defaults keep the wire at O(64) numbers per position and drop at most 1e-4 of the mass."""
        super().__init__(SessionStore(model, limits, name=name))
        self.top_m = top_m
        self.eps = eps

    def propose(self, session_id: str, step: int, k: int, commit: Commit | None = None) -> DraftProposal:
        session = self.store.get(session_id)
        with session.lock:
            if commit is not None:
                self.store.commit(session, commit)
            self.store.check_step(session, step)
            room = self.store.context_length - len(session.tokens)
            k = max(0, min(k, room - 1))
            tokens, qs = [], []
            counts = session.counts.clone()
            first = len(session.tokens)
            for i in range(k):
                logits = self.store.forward(session, tokens, rows=1)[0]
                probs = probs_from_logits(logits, session.params, counts)
                q = truncate(probs, self.top_m, self.eps)
                y = sample_sparse(q, uniform(session.seed, first + i, Purpose.DRAFT))
                tokens.append(y)
                qs.append(q)
                counts[y] += 1.0
            return DraftProposal(tokens, qs)
