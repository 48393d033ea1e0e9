"""The target engine: per-session KV caches over the large model; verifies a block in ONE pass.

verify() runs one causal pass over [uncached committed tokens (at least the pending token),
y_1..y_k], turns the last k + 1 logit rows into p_1..p_{k+1} with the shared transform pipeline
(penalties position-wise), validates every shipped q, and returns the target side of the
verifier (p_i(y_i), recovered draws, bonus draw). Dense p never leaves this object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.engine.commits import Commit
from specdec.engine.sessions import (
    CacheLimits,
    PassRequest,
    RowsRequest,
    Session,
    SessionEngine,
    SessionStore,
    Work,
    by_mode,
    run_alone,
)
from specdec.exact.gumbel import gumbel_argmax, gumbel_noise
from specdec.exact.logprobs import block_candidates, row_logprobs
from specdec.exact.rows import BlockRows, verify_rows
from specdec.exact.sampling import (
    RowParams,
    RowsOf,
    SamplingParams,
    block_token_counts,
    logprobs_from_logits,
    logprobs_rows,
    probs_from_logits,
    reported_logprobs,
)
from specdec.exact.sparse import SparseDist
from specdec.exact.verify import TargetVerdict, target_verify_greedy, validate_block


class TargetEngine(SessionEngine):
    def __init__(self, model, limits: CacheLimits | None = None, name: str = "target", kv_shards: int = 1, runner=None):
        """``kv_shards`` / ``runner``: a tensor-parallel shard and its lean pass (SessionStore)."""
        super().__init__(SessionStore(model, limits, name=name, kv_shards=kv_shards, runner=runner))

    @property
    def feature_size(self) -> int:
        """The width of the features it returns (its final hidden states)."""
        return int(self.store.model.config.hidden_size)

    def rank_stats(self) -> list[dict]:
        """Its parameter and KV bytes, as a tensor-parallel group reports each rank's."""
        from specdec.engine.tensor_parallel import local_param_bytes

        return [
            {
                "param_bytes": local_param_bytes(self.store.model),
                "kv_bytes": self.store.total_kv_bytes,
                "device": self.devices()[0],
            }
        ]

    def prefill_work(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, return_features: bool = False
    ) -> Work:
        """Start a session; with ``return_features`` the work's result is the target's final
        hidden states of every prompt position but the last, [len(prompt) - 1, H] (what a
        feature draft reads)."""
        return self.start_work(session_id, prompt, params, return_features)

    def prefill(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, return_features: bool = False
    ) -> torch.Tensor | None:
        """:meth:`prefill_work`, run alone."""
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
    def _invariant_tokens(session, logits, counts, allowed=None) -> list[int]:
        """The target's Gumbel-max token at each row's absolute position (specdec.exact.gumbel),
        under the constraint's masks of the rows (``allowed``; None: none)."""
        logprobs = logprobs_from_logits(
            logits, session.params, counts, prompt_seen=session.prompt_seen, allowed=allowed
        )
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
            allowed = session.allowed_along(proposals)  # the constraint's k + 1 masks (None: none)
            # the verdict, computed with every other block of the pass (VerifyRows.run_many)
            verdict = yield VerifyRows(session, logits, counts, proposals, q_block, allowed)
            if session.params.logprobs is not None:
                lp_rows = reported_logprobs(logits, session.params, counts, session.prompt_seen, allowed)
                candidates = block_candidates(proposals, verdict.recovered, verdict.bonus)
                verdict = replace(verdict, logprobs=row_logprobs(lp_rows, candidates, session.params.logprobs))
            return replace(verdict, features=features) if features is not None else verdict

    def step_work(self, session_id: str, step: int, commit: Commit | None = None) -> Work:
        """A step with nothing proposed (a target-only step: one row and its draw) as a work,
        whose result is the token it emits (what the startup profile times)."""
        verdict = yield from self.verify_work(session_id, step, [], [], commit)
        return verdict.bonus


@dataclass
class VerifyRows(RowsRequest):
    """One block's verdict from its k + 1 target rows (``logits`` [k + 1, V]; ``counts`` the
    rows' penalty histories or None), computed by :meth:`run_many` together with the other
    blocks of its pass."""

    session: Session
    logits: torch.Tensor
    counts: torch.Tensor | None
    proposals: list[int]
    q_block: Sequence[SparseDist]
    allowed: torch.Tensor | None = None  # the constraint's masks of the k + 1 rows

    @property
    def rows(self) -> RowsOf:
        return RowsOf(self.logits, self.session.params, self.counts, self.session.prompt_seen, self.allowed)

    @classmethod
    def run_many(cls, requests: list[VerifyRows]) -> list[TargetVerdict | BaseException]:
        """The verdicts of many blocks over all their rows at once (``sessions.by_mode``): for
        greedy blocks one argmax over their rows, for sampled blocks the transform with per-row
        parameters and the target side of the verifier over all of them (specdec.exact.rows).
        Invariant-sampling blocks (Gumbel-max keyed by position) keep their own computation."""
        return by_mode(requests, _greedy_verdicts, _sampled_verdicts, _invariant_verdict)


def _greedy_verdicts(requests: list[VerifyRows], rows: torch.Tensor) -> list[TargetVerdict]:
    """Greedy blocks: one-hot rows, whose argmaxes (ties to the lowest id) are the whole verdict."""
    argmax = rows.argmax(dim=-1).tolist()
    verdicts, start = [], 0
    for request in requests:
        end = start + len(request.proposals) + 1
        verdicts.append(target_verify_greedy(argmax[start:end], request.proposals))
        start = end
    return verdicts


def _sampled_verdicts(requests: list[VerifyRows], rows: torch.Tensor) -> list[TargetVerdict]:
    """Sampled blocks: the transform with each row's parameters, then the verifier over them all."""
    params = RowParams.of([(r.session.params, len(r.proposals) + 1) for r in requests])
    p_rows = logprobs_rows(rows, params).exp()
    blocks = [BlockRows(r.proposals, r.q_block, r.session.seed, len(r.session.tokens)) for r in requests]
    return verify_rows(p_rows, blocks)


def _invariant_verdict(request: VerifyRows) -> TargetVerdict:
    session = request.session
    tokens = TargetEngine._invariant_tokens(session, request.logits, request.counts, request.allowed)
    return target_verify_greedy(tokens, request.proposals)
