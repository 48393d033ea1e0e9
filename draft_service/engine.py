"""The draft engine: per-session KV caches over a small causal LM; proposes blocks with sparse q.

Proposal y_i is sampled from the transformed, truncated q_i it ships (same transform pipeline as
the target, penalties seeing the proposals before i), with the uniform keyed by
(seed, absolute position, DRAFT).
"""
from __future__ import annotations

import time
from typing import Sequence

from specdec.kv import CacheLimits, Commit, SessionStore
from specdec.proposal import DraftProposal
from specdec.rng import Purpose, uniform
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.sparse import sample_sparse, truncate


class DraftEngine:
    kind = "model"

    def __init__(self, model, limits: CacheLimits | None = None, top_m: int = 64, eps: float = 1e-4,
                 name: str = "draft"):
        """``top_m`` / ``eps``: the truncation policy of shipped q (0 turns either off). The
        defaults keep the wire at O(64) numbers per position and drop at most 1e-4 of the mass."""
        self.store = SessionStore(model, limits, name=name)
        self.top_m = top_m
        self.eps = eps
        self.model_id = getattr(model.config, "_name_or_path", "") or name

    @property
    def vocab_size(self) -> int:
        return self.store.vocab_size

    def prefill(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        session = self.store.create(session_id, prompt, params)
        with session.lock:
            try:
                self.store.warm(session)
            except BaseException:
                self.store.release(session_id)
                raise

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

    def commit(self, session_id: str, commit: Commit) -> None:
        session = self.store.get(session_id)
        with session.lock:
            self.store.commit(session, commit)

    def release(self, session_id: str) -> bool:
        return self.store.release(session_id)

    def expire_idle(self, ttl_seconds: float) -> list[str]:
        return self.store.expire_idle(ttl_seconds)

    def stats(self) -> dict:
        return self.store.stats()
