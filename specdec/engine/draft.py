"""The draft engines: per-session KV caches over a small model; they propose blocks with sparse q.

Proposal y_i is sampled from the transformed, truncated q_i it ships (same transform pipeline as
the target, penalties seeing the proposals before i), with the uniform keyed by
(seed, absolute position, DRAFT). An invariant-sampling session (docs/exactness.md) instead
proposes argmax(log q + g) with the target's Gumbel noise and ships no q. Two kinds:

- :class:`DraftEngine` ("model"): a standalone causal LM sharing the target's tokenizer.
- :class:`FeatureDraftEngine` ("feature"): a :class:`specdec.modeling.feature_draft.FeatureDraft`, which
  reads the target's hidden state before each committed token (they arrive with the prompt and
  with every commit) and drafts from its own predicted features.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdec.engine.commits import Commit
from specdec.engine.sessions import (
    CacheLimits,
    PassRequest,
    RowsRequest,
    Session,
    SessionEngine,
    SessionStore,
    WholeDraftWorks,
    Work,
    by_mode,
    cache_nbytes,
    run_alone,
    unwrap,
)
from specdec.errors import InvalidArgumentError
from specdec.exact.gumbel import gumbel_argmax, gumbel_noise
from specdec.exact.proposal import Branch, DraftProposal, check_assumed
from specdec.exact.rng import Purpose, uniform
from specdec.exact.sampling import (
    RowParams,
    RowsOf,
    SamplingParams,
    logprobs_from_logits,
    logprobs_rows,
)
from specdec.exact.sparse import SparseDist, sample_sparse, truncate


class _Proposer(SessionEngine):
    """What both kinds share: the truncation policy and one draw from a logits row."""

    def __init__(self, store: SessionStore, top_m: int, eps: float):
        """``top_m`` / ``eps``: the truncation policy of shipped q (0 turns either off). The
        defaults keep the wire at O(64) numbers per position and drop at most 1e-4 of the mass."""
        super().__init__(store)
        self.top_m = top_m
        self.eps = eps

    def _draw(
        self, session: Session, logits: torch.Tensor, counts: torch.Tensor, position: int, proposed: Sequence[int]
    ) -> tuple[int, SparseDist | None] | None:
        """The proposal at ``position`` after this block's ``proposed`` and the q it ships (None in
        invariant mode: none travels), computed alone (a feature draft's chain; a model draft's
        works go through DrawRows); None where the constraint admits no token of the head."""
        draw = self._draw_request(session, logits, counts, position, proposed)
        if nothing_admitted(draw, logits):
            return None
        return unwrap(DrawRows.run_many([draw])[0])

    def _draw_request(
        self, session: Session, logits: torch.Tensor, counts: torch.Tensor, position: int, proposed: Sequence[int] = ()
    ) -> DrawRows:
        """``proposed``: this block's proposals before this one (the constraint's state)."""
        allowed = session.allowed_after(proposed)
        return DrawRows(session, logits.reshape(1, -1), counts, position, self.top_m, self.eps, allowed)

    def _room(self, session: Session, k: int, assumed: int = 0) -> int:
        """How many of ``k`` proposals fit after the committed and ``assumed`` tokens (a step
        emits up to k + 1)."""
        return max(0, min(k, self.store.context_length - len(session.tokens) - assumed - 1))


class DraftEngine(_Proposer):
    kind = "model"
    feature_size = 0

    def __init__(
        self, model, limits: CacheLimits | None = None, top_m: int = 64, eps: float = 1e-4, name: str = "draft"
    ):
        super().__init__(SessionStore(model, limits, name=name), top_m, eps)

    def prefill_work(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> Work:
        return self.start_work(session_id, prompt, params)

    def prefill(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        run_alone(self.store, self.prefill_work(session_id, prompt, params))

    def propose(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None = None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> DraftProposal:
        return run_alone(self.store, self.propose_work(session_id, step, k, commit, assumed, rejections))

    def propose_work(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None = None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> Work:
        """:meth:`propose` as a work (specdec.engine.batching): one pass per proposal, each of
        which may share an iteration with other sessions' passes.

        ``assumed``: tokens taken as committed after the committed sequence without committing
        them (a pre-draft while the target verifies them: docs/pipelining.md). The block is drawn
        after them exactly as it would be once they are committed -- same positions, same keyed
        draws, their counts in the penalty history -- and the committed state is not touched; the
        cache keeps their KV, which the next pass reuses where the commit agrees with them.

        ``rejections``: also a branch for each of the first ``rejections`` positions j of
        ``assumed``: after ``assumed[:j]`` and the draft's likeliest other token there (its guess
        of the target's recovered token), k - 1 proposals, drawn as they would be after that
        prefix (``DraftProposal.branches``)."""
        session = self.store.get(session_id)
        with session.lock:
            if commit is not None:
                self.store.commit(session, commit)
            self.store.check_step(session, step)
            assumed = check_assumed(assumed, self.vocab_size)
            rejections = max(0, min(rejections, len(assumed)))
            guesses: list[int | None] = []
            if rejections:  # the draft's rows at those positions, in one pass of that many rows
                rows, _ = yield PassRequest(session, assumed[: rejections - 1], rejections)
                guesses = [
                    runner_up(session, rows[j], assumed[:j], assumed[j], len(session.tokens) + j)
                    for j in range(rejections)
                ]
            proposal = yield from self._block_after(session, assumed, k)
            branches = []
            for j, guess in enumerate(guesses):
                if guess is not None and k > 1:
                    prefix = (*assumed[:j], guess)
                    branches.append(Branch(prefix, (yield from self._block_after(session, prefix, k - 1))))
            return replace(proposal, branches=tuple(branches)) if branches else proposal

    def step_work(self, session_id: str, step: int, commit: Commit | None = None) -> Work:
        """A one-token proposal (one position and its q) as a work, whose result is that token
        (what the startup profile times)."""
        proposal = yield from self.propose_work(session_id, step, 1, commit)
        return proposal.tokens[0]

    def _block_after(self, session: Session, prefix: Sequence[int], k: int) -> Generator[Any, Any, DraftProposal]:
        """Up to ``k`` proposals after the committed tokens and ``prefix`` (see propose_work)."""
        tokens: list[int] = list(prefix)
        qs: list[SparseDist] = []
        counts = counts_after(session, prefix)
        first = len(session.tokens)
        for i in range(len(prefix), len(prefix) + self._room(session, k, len(prefix))):
            logits, _ = yield PassRequest(session, list(tokens), 1)
            draw = self._draw_request(session, logits[0], counts, first + i, tokens)
            if nothing_admitted(draw, logits[0]):
                break
            # drawn together with the other sessions' proposals of this pass (DrawRows.run_many)
            y, q = yield draw
            counts[y] += 1.0
            tokens.append(y)
            if q is not None:
                qs.append(q)
        return DraftProposal(tokens[len(prefix) :], qs)


def counts_after(session: Session, prefix: Sequence[int]) -> torch.Tensor:
    """The penalty history after the committed tokens and ``prefix`` (a copy: nothing committed)."""
    counts = session.counts.clone()
    for t in prefix:
        counts[t] += 1.0
    return counts


def runner_up(
    session: Session, logits: torch.Tensor, prefix: Sequence[int], excluded: int, position: int
) -> int | None:
    """The draft's likeliest token at ``position`` (after the committed tokens and ``prefix``)
    other than ``excluded``: its guess of the token the target recovers where it rejects
    ``excluded``. Greedy: the next best logit; invariant sampling: the next best under the
    target's noise there (what the target's Gumbel-max most likely picks instead); else the
    mode of q without ``excluded``. Only a guess: it picks which branch to draft, nothing else."""
    params = session.params
    allowed = session.allowed_after(prefix)
    scores = logprobs_from_logits(
        logits,
        replace(params, temperature=max(params.temperature, 1.0)) if params.greedy else params,
        counts_after(session, prefix),
        prompt_seen=session.prompt_seen,
        allowed=allowed,
    )
    if params.invariant:
        scores = scores + gumbel_noise(session.seed, [position], scores.shape[-1], device=scores.device)[0]
    scores[excluded] = -torch.inf
    best = int(scores.argmax())
    return best if bool(torch.isfinite(scores[best])) else None


def nothing_admitted(draw: DrawRows, logits: torch.Tensor) -> bool:
    """Whether a reduced head (modeling.heads) has no token the constraint admits at this draw:
    the block ends there, and the target's residual supplies the token."""
    return draw.allowed is not None and not bool((draw.allowed & torch.isfinite(logits)).any())


def _features(session: Session) -> torch.Tensor:
    """A feature-draft session's pending target features (set when it starts, never None after)."""
    assert session.features is not None, "a feature-draft session always holds its pending features"
    return session.features


class FeatureDraftEngine(WholeDraftWorks, _Proposer):  # its chain of one-position passes runs whole
    """Sessions over a feature draft. Per session it keeps the target's features of the committed
    tokens it has not fed yet (``session.features``: the feature before each token from
    ``session.features_from`` on). Its cache only ever holds committed tokens fed with the target's
    features: the positions a proposal feeds with the draft's own predictions are cut off before
    ``propose`` returns, so an accepted proposal is re-fed with the target's feature at the next
    step (what makes the next block's first proposal as good as a fresh one)."""

    kind = "feature"

    def __init__(
        self, model, limits: CacheLimits | None = None, top_m: int = 64, eps: float = 1e-4, name: str = "draft"
    ):
        # one decoder layer: a one-layer LeanCache
        super().__init__(SessionStore(model, limits, name=name, new_cache=model.new_cache), top_m, eps)
        self.model = model
        self.feature_size = int(model.config.hidden_size)

    def _check_features(self, features: torch.Tensor | None, rows: int, field: str) -> torch.Tensor:
        if features is None:
            raise InvalidArgumentError(
                field,
                "a feature draft needs the target's features (the coordinator sends "
                "them when the draft reports draft_kind 'feature')",
            )
        if features.ndim != 2 or features.shape[0] != rows or features.shape[1] != self.feature_size:
            raise InvalidArgumentError(
                field, f"expected [{rows}, {self.feature_size}] features, got {list(features.shape)}"
            )
        return features.to(dtype=torch.float32)

    def prefill(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, features: torch.Tensor | None = None
    ) -> None:
        """``features``: the target's feature after each prompt token but the last, [len - 1, H]."""
        features = self._check_features(features, max(0, len(prompt) - 1), "features")
        session = self.store.create(session_id, prompt, params)
        with session.lock:
            session.features = torch.cat((features.new_zeros(1, self.feature_size), features))  # token 0: none
            session.features_from = 0
            try:
                self._feed(session, len(session.tokens) - 1)
            except BaseException:
                self.store.release(session_id)
                raise

    def commit(self, session_id: str, commit: Commit) -> None:
        session = self.store.get(session_id)
        with session.lock:
            self._commit(session, commit)

    def _commit(self, session: Session, commit: Commit) -> None:
        features = self._check_features(commit.features, len(commit.tokens), "commit.features")
        before = len(session.tokens)
        self.store.commit(session, commit)
        if len(session.tokens) > before:  # not a retry of a commit already applied
            session.features = torch.cat((_features(session), features))

    def _feed(self, session: Session, upto: int) -> torch.Tensor | None:
        """Feed committed tokens [len(cached), upto) with their target features; returns the
        predicted features of the positions fed (None when nothing was fed)."""
        start = len(session.cached)
        if upto <= start:
            return None
        self.store._reserve(session, upto)
        offset = session.features_from
        tokens = torch.tensor(session.tokens[start:upto], dtype=torch.long, device=self.store.device)
        fed = _features(session)[start - offset : upto - offset].to(self.store.device)
        hidden = self.model.extend(tokens, fed, session.cache)
        session.cached.extend(session.tokens[start:upto])
        # Features of positions now cached are needed again only for the last one (re-fed when a
        # propose arrives without a new commit); drop the rest.
        keep_from = max(offset, upto - 1)
        session.features = _features(session)[keep_from - offset :]
        session.features_from = keep_from
        session.kv_bytes = cache_nbytes(session.cache)
        return hidden

    @torch.inference_mode()
    def propose(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None = None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> DraftProposal:
        if assumed:  # its first proposal needs the target's features of the assumed tokens
            raise InvalidArgumentError("assumed", "a feature draft cannot draft ahead of the target's verdict")
        session = self.store.get(session_id)
        with session.lock:
            if commit is not None:
                self._commit(session, commit)
            self.store.check_step(session, step)
            k = self._room(session, k)
            if k == 0:
                return DraftProposal([], [])
            self.store.sync_cache(session, min_feed=1)  # the last committed token's output starts the block
            fed = self._feed(session, len(session.tokens))
            assert fed is not None  # sync_cache left the last committed token to feed
            hidden = fed[-1:]
            tokens: list[int] = []
            qs: list[SparseDist] = []
            counts = session.counts.clone()
            first = len(session.tokens)
            try:
                for i in range(k):
                    drawn = self._draw(session, self.model.logits(hidden)[0], counts, first + i, tokens)
                    if drawn is None:
                        break
                    y, q = drawn
                    counts[y] += 1.0
                    tokens.append(y)
                    if q is not None:
                        qs.append(q)
                    if i + 1 < k:  # the draft's prediction stands in for the target's feature
                        hidden = self.model.extend(torch.tensor([y], device=self.store.device), hidden, session.cache)
            finally:
                drafted = session.cache.length - len(session.cached)
                if drafted > 0:
                    session.cache.crop(-drafted)  # positions fed with the draft's own features
            return DraftProposal(tokens, qs)


def draft_engine_for(model, limits: CacheLimits | None = None, **kwargs) -> _Proposer:
    """The engine that drafts with ``model``: a feature draft or a standalone LM."""
    from specdec.modeling.feature_draft import FeatureDraft

    engine = FeatureDraftEngine if isinstance(model, FeatureDraft) else DraftEngine
    return engine(model, limits, **kwargs)


@dataclass
class DrawRows(RowsRequest):
    """One proposal's draw from its draft logits row (``logits`` [1, V]; ``counts`` the penalty
    history with the proposals before it), computed by :meth:`run_many` with the other sessions'
    draws of the same pass. The caller counts the drawn token into ``counts``."""

    session: Session
    logits: torch.Tensor
    counts: torch.Tensor
    position: int
    top_m: int
    eps: float
    allowed: torch.Tensor | None = None  # the constraint's mask of the row ([V] bool)

    @property
    def rows(self) -> RowsOf:
        allowed = None if self.allowed is None else self.allowed.reshape(1, -1)
        return RowsOf(self.logits, self.session.params, self.counts, self.session.prompt_seen, allowed)

    @classmethod
    def run_many(cls, requests: list[DrawRows]) -> list[tuple[int, SparseDist | None] | BaseException]:
        """Every draw at once (``sessions.by_mode``): one argmax over the greedy rows, the
        transform with per-row parameters over the sampled rows, then each sampled row's
        truncated q and its draw with its keyed uniform. Invariant-sampling draws (Gumbel-max
        with the target's noise) keep their own computation."""
        return by_mode(requests, _greedy_draws, _sampled_draws, _invariant_draw)


def _greedy_draws(requests: list[DrawRows], rows: torch.Tensor) -> list[tuple[int, SparseDist | None]]:
    """q is the one-hot on the argmax (not shipped in invariant mode)."""
    tokens = rows.argmax(dim=-1).tolist()
    return [
        (y, None if r.session.params.invariant else SparseDist.one_hot(y))
        for r, y in zip(requests, tokens, strict=True)
    ]


def _sampled_draws(requests: list[DrawRows], rows: torch.Tensor) -> list[tuple[int, SparseDist | None]]:
    probs = logprobs_rows(rows, RowParams.of([(r.session.params, 1) for r in requests])).exp()
    draws: list[tuple[int, SparseDist | None]] = []
    for request, row in zip(requests, probs, strict=True):  # the shipped q is one sparse object per row
        q = truncate(row, request.top_m, request.eps)
        draws.append((sample_sparse(q, uniform(request.session.seed, request.position, Purpose.DRAFT)), q))
    return draws


def _invariant_draw(request: DrawRows) -> tuple[int, SparseDist | None]:
    """y = argmax(log q + g) with the target's noise at this position, q under the constraint's
    mask of the row where there is one; q itself is not needed."""
    session = request.session
    logprobs = logprobs_from_logits(
        request.logits[0], session.params, request.counts, prompt_seen=session.prompt_seen, allowed=request.allowed
    )
    noise = gumbel_noise(session.seed, [request.position], logprobs.shape[-1], device=logprobs.device)
    return gumbel_argmax(logprobs.reshape(1, -1), noise)[0], None
