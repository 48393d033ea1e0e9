"""The target engine: per-session KV caches over the large model; verifies a block in ONE pass.

verify() runs one causal pass over [uncached committed tokens (at least the pending token),
y_1..y_k], turns the last k + 1 logit rows into p_1..p_{k+1} with the shared transform pipeline
(penalties position-wise), validates every shipped q, and returns the target side of the
verifier (p_i(y_i), recovered draws, bonus draw). Dense p never leaves this object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from specdec.engine.commits import Commit
from specdec.engine.sessions import CacheLimits, PassRequest, SessionEngine, SessionStore, Work, run_alone
from specdec.exact.gumbel import gumbel_argmax, gumbel_noise
from specdec.exact.logprobs import block_candidates, row_logprobs
from specdec.exact.sampling import (
    SamplingParams,
    block_token_counts,
    greedy_tokens,
    logprobs_from_logits,
    probs_from_logits,
    reported_logprobs,
)
from specdec.exact.sparse import SparseDist
from specdec.exact.verify import TargetVerdict, target_verify, target_verify_greedy, validate_block


class TargetEngine(SessionEngine):
    supports_works = True  # its calls run as works: specdec.engine.batching batches them

    def __init__(self, model, limits: CacheLimits | None = None, name: str = "target", kv_shards: int = 1, runner=None):
        """``kv_shards`` / ``runner``: a tensor-parallel shard and its lean pass (SessionStore)."""
        super().__init__(SessionStore(model, limits, name=name, kv_shards=kv_shards, runner=runner))

    def prefill(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, return_features: bool = False
    ) -> torch.Tensor | None:
        """Start a session; with ``return_features`` the target's final hidden states of every
        prompt position but the last, [len(prompt) - 1, H] (what a feature draft reads)."""
        return run_alone(self.store, self.prefill_work(session_id, prompt, params, return_features))

    def target_probs(self, session_id: str, proposals: Sequence[int]):
        """p_1..p_{k+1} for a block (dense; for tests and introspection, not for the wire)."""
        session = self.store.get(session_id)
        with session.lock:
            proposals = list(proposals)
            logits = self.store.forward(session, proposals, len(proposals) + 1)
            counts = block_token_counts(session.counts, proposals) if session.params.needs_counts else None
            return probs_from_logits(logits, session.params, counts, prompt_seen=session.prompt_seen)

    @staticmethod
    def _invariant_tokens(session, logits, counts) -> list[int]:
        """The target's Gumbel-max token at each row's absolute position (specdec.exact.gumbel)."""
        logprobs = logprobs_from_logits(logits, session.params, counts, prompt_seen=session.prompt_seen)
        first = len(session.tokens)
        positions = list(range(first, first + logprobs.shape[0]))
        return gumbel_argmax(logprobs, gumbel_noise(session.seed, positions, logprobs.shape[-1], logprobs.device))

    def verify(
        self,
        session_id: str,
        step: int,
        proposals: Sequence[int],
        q_block: Sequence[SparseDist],
        commit: Commit | None = None,
        return_features: bool = False,
    ) -> TargetVerdict:
        """``return_features``: the verdict carries the block's features (for a feature draft)."""
        return run_alone(self.store, self.verify_work(session_id, step, proposals, q_block, commit, return_features))

    def verify_work(
        self,
        session_id: str,
        step: int,
        proposals: Sequence[int],
        q_block: Sequence[SparseDist],
        commit: Commit | None = None,
        return_features: bool = False,
    ) -> Work:
        """:meth:`verify` as a work (specdec.engine.batching): its one pass over the uncached
        tokens and the proposals may share an iteration with other sessions' passes."""
        session = self.store.get(session_id)
        with session.lock:
            if commit is not None:
                self.store.commit(session, commit)
            self.store.check_step(session, step)
            proposals = [int(t) for t in proposals]
            validate_block(proposals, q_block, self.vocab_size, invariant=session.params.invariant)
            logits, features = yield PassRequest(session, proposals, len(proposals) + 1, return_features)
            counts = block_token_counts(session.counts, proposals) if session.params.needs_counts else None
            if session.params.greedy:  # one-hot rows: their argmaxes are the whole verdict
                greedy = greedy_tokens(logits, session.params, counts, session.prompt_seen)
                verdict = target_verify_greedy(greedy.tolist(), proposals)
            elif session.params.invariant:  # x_t = argmax(log p_t + g_t): a proposal stands iff it is x_t
                verdict = target_verify_greedy(self._invariant_tokens(session, logits, counts), proposals)
            else:
                p_rows = probs_from_logits(logits, session.params, counts, prompt_seen=session.prompt_seen)
                verdict = target_verify(p_rows, proposals, q_block, session.seed, len(session.tokens))
            if session.params.logprobs is not None:
                lp_rows = reported_logprobs(logits, session.params, counts, session.prompt_seen)
                candidates = block_candidates(proposals, verdict.recovered, verdict.bonus)
                verdict = replace(verdict, logprobs=row_logprobs(lp_rows, candidates, session.params.logprobs))
            return replace(verdict, features=features) if features is not None else verdict
