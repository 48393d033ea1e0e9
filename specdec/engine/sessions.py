"""Per-session KV caches over one transformers causal LM, shared by the draft and target engines.

The one invariant everything rests on: ``session.cached`` is *exactly* the token sequence whose
keys/values the cache holds. Before any forward pass the cache is cut back to the longest common
prefix of ``cached`` and the committed tokens (and never past the last committed token, whose
logits the next pass needs), so rejected proposals can never leak into a later step (the cache bug
of docs/exactness.md). Commits are applied in step order, are idempotent, and a stale or out-of-order
commit is refused, never applied.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.engine.commits import Commit, CommitLedger
from specdec.engine.prefix import PrefixCache
from specdec.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
)
from specdec.exact.sampling import SamplingParams, constraint_conflict, token_counts, transformed_rows
from specdec.modeling.cache import LeanCache
from specdec.modeling.dimensions import context_length, kv_bytes_per_token
from specdec.modeling.lean_llama import LeanLlama, Pass, lean_runner
from specdec.modeling.loading import device_identity
from specdec.modeling.paged import PagedCache

log = logging.getLogger("specdec.sessions")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# The caches the project's passes keep (paged for the lean pass, contiguous for a feature draft):
# grown by reserve(), accounted in what they hold allocated
OWN_CACHES = (PagedCache, LeanCache)


def cache_nbytes(cache) -> int:
    if isinstance(cache, OWN_CACHES):
        return cache.nbytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@dataclass
class Session:
    session_id: str
    tokens: list[int]  # committed sequence: prompt + generated
    prompt_len: int
    params: SamplingParams  # seed already resolved
    # a PagedCache (the lean pass), a LeanCache (a feature draft), or a transformers Cache (models
    # the lean pass does not cover); None once released
    cache: Any
    counts: torch.Tensor  # token counts of the generated tokens, ``tokens[prompt_len:]`` (penalty history)
    prompt_seen: torch.Tensor  # bool [V]: the prompt's tokens (the repetition penalty's history too)
    cached: list[int] = field(default_factory=list)
    copied: int = 0  # prompt positions its start copied from the prefix cache (what a client is told)
    kv_bytes: int = 0
    # feature drafts only: the target's feature before each committed token from ``features_from`` on
    features: torch.Tensor | None = None
    features_from: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.RLock = field(default_factory=threading.RLock)
    ledger: CommitLedger = field(init=False)  # where the session stands in the commit protocol
    # structured output: the constraint's matcher, following the committed generated tokens
    # (specdec.modeling.grammar; None: unconstrained)
    matcher: Any = None

    def __post_init__(self) -> None:
        self.ledger = CommitLedger(self.session_id)

    @property
    def seed(self) -> int:
        assert self.params.seed is not None
        return self.params.seed

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def allowed_along(self, extra: Sequence[int]) -> torch.Tensor | None:
        """The constraint's masks ([len(extra) + 1, V] bool) at the committed end and after each
        of ``extra`` (a verify block's proposals), or None when the session has no constraint."""
        if self.matcher is None:
            return None
        self.matcher.follow(self.generated)
        return self.matcher.masks_along(list(extra))

    def allowed_after(self, extra: Sequence[int]) -> torch.Tensor | None:
        """The constraint's mask ([V] bool) after the committed tokens and ``extra`` (a draft's
        own proposals so far), or None when the session has no constraint."""
        if self.matcher is None:
            return None
        self.matcher.follow(self.generated)
        return self.matcher.allowed_after(list(extra))


@dataclass
class PassRequest:
    """One forward pass a session needs (the unit :mod:`specdec.engine.batching` batches): run
    the uncached part of ``session.tokens + extra`` (after the cache is cut back to what still
    agrees with it), and return the logits of its last ``rows`` positions [rows, V] and, with
    ``with_features``, their final hidden states [rows, H] (else None).

    ``prefill``: cache the committed tokens before ``upto`` (all but the last, whose logits start
    the first step) and return no logits, only, with ``with_features``, the hidden states of the
    positions fed; the scheduler may feed only a chunk of them per pass (chunked prefill)."""

    session: Session
    extra: list[int] = field(default_factory=list)
    rows: int = 1
    with_features: bool = False
    prefill: bool = False
    upto: int = 0


class RowsRequest:
    """What a work computes from its pass's rows (a verdict, a draw) when that math is written
    for the rows of many works at once: the runner hands every such request of an iteration to
    one :meth:`run_many` call (of the request's class) right after the pass, so the math runs over
    all their rows together instead of once per session (docs/batching.md)."""

    @classmethod
    def run_many(cls, requests: list[Any]) -> list[Any]:
        """Each request's result (or the exception that refused it), in order."""
        raise NotImplementedError


# an engine call: yields its passes (and its rows' math), receives their results
Work = Generator["PassRequest | RowsRequest", Any, Any]


def run_rows(requests: list[RowsRequest]) -> list[Any]:
    """:meth:`RowsRequest.run_many` of every request, one call per request class; an exception
    that call raises is every one of its requests' result."""
    results: list[Any] = [None] * len(requests)
    kinds: dict[type[RowsRequest], list[int]] = {}
    for index, request in enumerate(requests):
        kinds.setdefault(type(request), []).append(index)
    for kind, indices in kinds.items():
        try:
            out = kind.run_many([requests[i] for i in indices])
        except Exception as exc:  # noqa: BLE001 - this math failed: its works' error, not the batch's
            out = [exc] * len(indices)
        for i, result in zip(indices, out, strict=True):
            results[i] = result
    return results


def run_alone(store: SessionStore | None, work: Work) -> Any:
    """The work's result, running its passes one by one, with nothing else in them. ``store``:
    where its passes run (None for an engine whose works ask for none: see :func:`whole`).

    A work never outlives this call: one left suspended would be closed later by the garbage
    collector, on whatever thread that runs, inside the session lock its own thread holds."""
    try:
        request = next(work)
        while True:
            if isinstance(request, RowsRequest):
                result = run_rows([request])[0]
            elif store is None:
                result = RuntimeError("a work asked for a forward pass but has no store to run it on")
            else:
                result = store.run_requests([(request, None)])[0]
            request = work.throw(result) if isinstance(result, BaseException) else work.send(result)
    except StopIteration as done:
        return done.value
    finally:
        work.close()  # (a finished work: nothing to do)


def whole(call: Callable[..., Any], *args: Any) -> Work:
    """``call(*args)`` as a work that asks for no pass: it runs whole when the work starts. The
    call shape of an engine whose operations share no batched pass (an n-gram lookup, a feature
    draft's chain), so every engine offers the same works."""
    return call(*args)
    yield  # a generator: nothing runs before the work starts


class WholeDraftWorks:
    """The works of a draft whose operations share no batched pass (an n-gram lookup, a feature
    draft's chain): its plain ``prefill`` / ``propose``, run whole when the work starts. It has no
    ``batch_store``: a replica runs its works alone."""

    prefill: Callable[..., Any]
    propose: Callable[..., Any]

    @property
    def batch_store(self) -> None:
        return None

    def prefill_work(self, *args: Any) -> Work:
        """``prefill(*args)`` as a work."""
        return whole(self.prefill, *args)

    def propose_work(self, *args: Any) -> Work:
        """``propose(*args)`` as a work."""
        return whole(self.propose, *args)


def _on_host(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits rows of a pass as float32 on the CPU: where they are not already, one copy for all
    of them (one device-to-host transfer per pass, not one per session)."""
    if all(r.device.type == "cpu" and r.dtype == torch.float32 for r in rows):
        return rows
    host = torch.cat(rows).to(device="cpu", dtype=torch.float32)
    return list(host.split([r.shape[0] for r in rows]))


def by_mode(
    requests: Sequence[Any],
    greedy: Callable[[list[Any], torch.Tensor], list[Any]],
    sampled: Callable[[list[Any], torch.Tensor], list[Any]],
    invariant: Callable[[Any], Any],
) -> list[Any]:
    """The results of row requests of many sessions (each with ``session`` and ``rows``, a
    :class:`~specdec.exact.sampling.RowsOf`), computed per sampling mode over all their rows at
    once: ``greedy`` and ``sampled`` take the requests of that mode and their rows as one tensor
    after bias, penalties and the finiteness check (``transformed_rows``), and return one result
    each; ``invariant`` (Gumbel-max keyed by position) takes one request. A request whose rows
    are refused, or whose computation raises, gets the exception as its result."""
    out: list[Any] = [None] * len(requests)
    modes: dict[str, list[int]] = {"greedy": [], "sampled": []}
    for index, request in enumerate(requests):
        params = request.session.params
        if params.greedy:
            modes["greedy"].append(index)
        elif params.invariant:
            out[index] = outcome(functools.partial(invariant, request))
        else:
            modes["sampled"].append(index)
    for indices, compute in ((modes["greedy"], greedy), (modes["sampled"], sampled)):
        rows, refusals = transformed_rows([requests[i].rows for i in indices])
        for position, refused in refusals.items():
            out[indices[position]] = refused
        live = [i for position, i in enumerate(indices) if position not in refusals]
        if live:
            results = outcome(functools.partial(compute, [requests[i] for i in live], rows))
            for i, result in zip(live, results if isinstance(results, list) else [results] * len(live), strict=True):
                out[i] = result
    return out


def outcome(compute: Callable[[], Any]) -> Any:
    """What ``compute`` returns, or the exception it raises."""
    try:
        return compute()
    except Exception as exc:  # noqa: BLE001 - the request's own error, handed to it
        return exc


def unwrap(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result


@dataclass(frozen=True)
class CacheLimits:
    max_sessions: int = 256
    max_session_kv_bytes: int = 0  # 0 = unlimited
    max_total_kv_bytes: int = 0  # 0 = unlimited
    prefix_cache_bytes: int = 0  # KV of computed prefixes kept for new sessions (0 = none; specdec.engine.prefix)


class SessionStore:
    """Sessions of one model: creation with validation, caps, forward passes, commits."""

    def __init__(
        self,
        model,
        limits: CacheLimits | None = None,
        name: str = "engine",
        kv_shards: int = 1,
        new_cache: Callable[[], Any] | None = None,
        runner: LeanLlama | None = None,
    ):
        """``kv_shards``: tensor-parallel ranks the KV heads are split over (bytes are per rank).
        ``new_cache``: makes a session's cache, for a model with its own kind (a feature draft).
        ``runner``: a tensor-parallel shard's lean pass (``specdec.modeling.sharding``); without
        one a shard keeps transformers' forward, whose layers carry the collectives."""
        self.model = model
        self.name = name
        self.limits = limits or CacheLimits()
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = context_length(model)
        self.device = next(model.parameters()).device
        self.bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype) // kv_shards
        self._sessions: dict[str, Session] = {}
        self._table_lock = threading.Lock()
        # The lean pass (specdec/modeling/lean_llama.py) where it applies
        self.runner = lean_runner(model) if kv_shards == 1 else runner
        # A shard's failed pass may have left its caches unlike the other ranks': not one request's
        # error but the group's (specdec.engine.tensor_parallel), so it is raised.
        self.pass_errors_fatal = kv_shards > 1
        self.sessions_started = 0
        self._make_cache = new_cache
        # structured output: compiled constraints over this replica's tokenizer (the service sets
        # it; None: sessions with a constraint are refused)
        self.grammars: Any = None
        if self.runner is not None:  # what the pool's blocks hold, exactly
            self.bytes_per_token = self.runner.pool.block_bytes // self.runner.pool.block
        if self.runner is not None and self.limits.max_total_kv_bytes:
            # the pool never needs more than the caps let sessions and the prefix cache hold
            pool = self.runner.pool
            most = (self.limits.max_total_kv_bytes + self.limits.prefix_cache_bytes) // pool.block_bytes
            pool.bound(most, preallocate=self.device.type == "cuda")
        # Only where a shared prefix is the same bits as a computed one: a batch-invariant backend's
        # passes (each row on its own) into paged caches (specdec.engine.prefix).
        exact_copies = self.batch_invariant and new_cache is None
        self.prefixes = (
            PrefixCache(self.limits.prefix_cache_bytes, self.runner.pool)
            if self.limits.prefix_cache_bytes and exact_copies and self.runner is not None
            else None
        )

    # -- table --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._sessions))

    @property
    def total_kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in list(self._sessions.values()))

    def get(self, session_id: str) -> Session:
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(f"{self.name}: unknown session {session_id!r}") from None
        session.last_used = time.monotonic()
        return session

    def create(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> Session:
        if params.seed is None:
            raise InvalidArgumentError("seed", "engines need a resolved seed (the coordinator assigns one)")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgumentError("prompt", "must contain at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                "prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.context_length:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt)} tokens leave no room in the model context of {self.context_length}"
            )
        params.validate_for_vocab(self.vocab_size)
        matcher = self._matcher(params)
        self._check_capacity()
        self._reserve(None, len(prompt))
        # a session started from prompt + generated tokens (resume, failover, a late draft) is
        # told where the prompt ends: the penalties count the two differently
        prompt_len = params.prompt_length if 0 < params.prompt_length <= len(prompt) else len(prompt)
        session = Session(
            session_id=session_id,
            tokens=prompt,
            prompt_len=prompt_len,
            params=params,
            cache=self._new_cache(),
            counts=token_counts(prompt[prompt_len:], self.vocab_size),
            prompt_seen=token_counts(prompt[:prompt_len], self.vocab_size) > 0,
            matcher=matcher,
        )
        try:
            self._reserve(session, len(prompt))  # the prompt's KV is allocated (and accounted) from the start
            with self._table_lock:
                if session_id in self._sessions:
                    raise SessionExistsError(f"{self.name}: session {session_id!r} already exists")
                self._check_capacity()
                self._sessions[session_id] = session
                self.sessions_started += 1
        except BaseException:
            _free(session.cache)  # its blocks go back now, not when the collector finds them
            raise
        return session

    def _matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher for the session's constraint (None without one)."""
        if params.constraint is None:
            return None
        if self.grammars is None:
            raise InvalidArgumentError("sampling.structured_output", f"{self.name} does not serve constraints")
        conflict = constraint_conflict(params)
        if conflict:
            raise InvalidArgumentError("sampling.structured_output", f"cannot be combined with {conflict}")
        return self.grammars.matcher(params.constraint, params.cache_salt)  # scoped as the prefix cache

    def release(self, session_id: str) -> bool:
        with self._table_lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        with session.lock:
            try:
                self.keep_prefix(session)  # a next turn of the chat starts with all of it
            except Exception as exc:  # noqa: BLE001 - an optimization: the release must happen anyway
                log.error("%s: keeping session %s in the prefix cache failed: %r", self.name, session_id, exc)
            _free(session.cache)
            session.cache = None
            session.cached = []
            session.features = None
            session.kv_bytes = 0
        return True

    def stale_sessions(self, ttl_seconds: float) -> list[str]:
        now = time.monotonic()
        return [sid for sid, s in list(self._sessions.items()) if now - s.last_used > ttl_seconds]

    def expire_idle(self, ttl_seconds: float) -> list[str]:
        """Release sessions unused for ``ttl_seconds`` (abandoned by a dead coordinator)."""
        return [sid for sid in self.stale_sessions(ttl_seconds) if self.release(sid)]

    # -- prefix cache -------------------------------------------------------------------------
    def reuse_prefix(self, session: Session, upto: int) -> int:
        """Start a session that has cached nothing yet from the longest kept prefix of
        ``session.tokens[:upto]`` (its blocks shared, not copied); returns how many positions it
        now holds."""
        if self.prefixes is None or session.cached or not isinstance(session.cache, PagedCache):
            return 0
        chain = self.prefixes.lookup(session.tokens, upto, session.params.cache_salt)
        if not chain:
            return 0
        session.cache.adopt([block.pool_block for block in chain])  # in place of blocks create reserved
        length = session.cache.length
        session.cached = list(session.tokens[:length])
        session.copied = length
        return length

    @contextlib.contextmanager
    def scratch_sessions(self) -> Iterator[None]:
        """Sessions started inside are not served ones (a startup profile's): they neither read
        nor fill the prefix cache, and do not count as started."""
        prefixes, started = self.prefixes, self.sessions_started
        self.prefixes = None
        try:
            yield
        finally:
            self.prefixes, self.sessions_started = prefixes, started

    def copied_positions(self, session_id: str) -> int:
        """How many positions the session's start copied from the prefix cache (0: none, or gone)."""
        session = self._sessions.get(session_id)
        return session.copied if session is not None else 0

    def keep_prefix(self, session: Session) -> None:
        """Keep the whole blocks of what the session has cached (its positions agree with its
        ``cached`` tokens whatever they are: a rejected proposal's too)."""
        if self.prefixes is None or not isinstance(session.cache, PagedCache) or not session.cached:
            return
        cache = session.cache
        self.prefixes.insert(session.cached[: cache.length], cache.blocks, session.params.cache_salt)

    def _new_cache(self) -> Any:
        if self._make_cache is not None:
            return self._make_cache()
        if self.runner is not None:
            return self.runner.new_cache()
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _run(
        self, cache, feed: list[int], rows: int, feature_rows: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the last ``rows`` of ``feed`` (appended to ``cache``), [rows, V], and with
        ``feature_rows`` the model's final hidden states (what its head reads) of the last
        ``feature_rows`` positions, [feature_rows, H] (else None)."""
        return self._run_many([(cache, feed, rows, feature_rows)])[0]

    def _run_many(
        self, passes: list[tuple[Any, list[int], int, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`_run` for several (cache, feed, rows, feature_rows) passes: one batched pass
        through the lean runner (every pass of a session goes there, alone or not, so its bits
        never depend on what shared its passes), else one transformers pass each."""
        if self.runner is not None:
            return self.runner.forward_batch(
                [
                    Pass(torch.tensor(feed, dtype=torch.long, device=self.device), cache, rows, f)
                    for cache, feed, rows, f in passes
                ]
            )
        results = []
        for cache, feed, rows, feature_rows in passes:
            input_ids = torch.tensor([feed], dtype=torch.long, device=self.device)
            out = self.model(
                input_ids=input_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=max(rows, 1),
                output_hidden_states=feature_rows > 0,
            )
            features = out.hidden_states[-1][0, len(feed) - feature_rows :] if feature_rows else None
            results.append((out.logits[0, out.logits.shape[1] - rows :], features))
        return results

    @property
    def batches(self) -> bool:
        """Whether passes of several sessions run as one (the lean runner, on every backend)."""
        return self.runner is not None and self.runner.batches

    @property
    def batch_invariant(self) -> bool:
        """Whether a session's bits are independent of what shares its passes and of how its
        positions are split into passes: only then may a prefill be fed in chunks of any size,
        or a prefix be copied, without changing its bits."""
        return self.runner is not None and self.runner.batch_invariant

    @property
    def pass_backend(self) -> str:
        """The batched pass's backend (specdec.modeling.lean_llama), or "transformers" (one
        session's pass at a time, in transformers' forward)."""
        return self.runner.backend if self.runner is not None else "transformers"

    # -- caps ---------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        if len(self._sessions) >= self.limits.max_sessions:
            raise ResourceExhaustedError(
                f"{self.name}: {len(self._sessions)} live sessions, the cap is {self.limits.max_sessions}"
            )

    def _reserve(self, session: Session | None, tokens_after: int) -> None:
        """Make room for ``tokens_after`` positions in the session's cache (None: a session about
        to start), within the caps, or raise RESOURCE_EXHAUSTED touching nothing. The KV pool is
        accounted in allocated bytes: a paged cache in whole blocks, a contiguous one grown by a
        quarter, never past what the caps leave it (then exactly to what it needs)."""
        projected = self._projected_bytes(session, tokens_after)
        limits = self.limits
        if limits.max_session_kv_bytes and projected > limits.max_session_kv_bytes:
            raise ResourceExhaustedError(
                f"{self.name}: session KV cache would need {projected} bytes, the per-session cap is "
                f"{limits.max_session_kv_bytes}"
            )
        if limits.max_total_kv_bytes:
            current = session.kv_bytes if session is not None else 0
            total = self.total_kv_bytes - current + projected
            if total > limits.max_total_kv_bytes:
                raise ResourceExhaustedError(
                    f"{self.name}: KV caches would need {total} bytes in all, the cap is {limits.max_total_kv_bytes}"
                )
        if session is not None and isinstance(session.cache, OWN_CACHES):
            session.cache.reserve(tokens_after, self._most_tokens(session))
            session.kv_bytes = cache_nbytes(session.cache)

    def _most_tokens(self, session: Session) -> int | None:
        """The most positions the caps let this session's cache hold (None: no cap)."""
        limits, per_token = self.limits, self.bytes_per_token
        caps = []
        if limits.max_session_kv_bytes:
            caps.append(limits.max_session_kv_bytes // per_token)
        if limits.max_total_kv_bytes:
            caps.append((limits.max_total_kv_bytes - self.total_kv_bytes + session.kv_bytes) // per_token)
        return min(caps) if caps else None

    def _projected_bytes(self, session: Session | None, tokens_after: int) -> int:
        if session is None or not isinstance(session.cache, OWN_CACHES):
            return self._new_cache_bytes(tokens_after)
        return session.cache.planned_capacity(tokens_after, self._most_tokens(session)) * self.bytes_per_token

    def _new_cache_bytes(self, tokens: int) -> int:
        """What a new cache holding ``tokens`` positions holds allocated: whole blocks of the pool
        for a paged cache."""
        pool = self.runner.pool if self.runner is not None and self._make_cache is None else None
        if pool is None:
            return tokens * self.bytes_per_token
        return pool.blocks_for(tokens) * pool.block * self.bytes_per_token

    def has_room(self, prompt_tokens: int) -> bool:
        """Whether a session of ``prompt_tokens`` could start now (admission control)."""
        try:
            self._check_capacity()
            self._reserve(None, prompt_tokens)
        except ResourceExhaustedError:
            return False
        return True

    def could_ever_fit(self, prompt_tokens: int) -> bool:
        """Whether a session of ``prompt_tokens`` fits an empty pool (else waiting is pointless)."""
        limits, need = self.limits, self._new_cache_bytes(prompt_tokens)
        return not (limits.max_session_kv_bytes and need > limits.max_session_kv_bytes) and not (
            limits.max_total_kv_bytes and need > limits.max_total_kv_bytes
        )

    # -- steps and commits --------------------------------------------------------------------
    @staticmethod
    def check_step(session: Session, step: int) -> None:
        session.ledger.check_step(step)

    def commit(self, session: Session, commit: Commit) -> None:
        """Append committed tokens (the protocol of specdec.engine.commits: idempotent for a
        repeated commit, refuses stale and out-of-order ones)."""
        if not session.ledger.admits(commit, len(session.tokens)):
            return  # a retry of the commit already applied
        new = [int(t) for t in commit.tokens]
        if any(not 0 <= t < self.vocab_size for t in new):
            raise InvalidArgumentError("commit.tokens", "token id outside the vocabulary")
        if len(session.tokens) + len(new) > self.context_length:
            raise InvalidArgumentError("commit.tokens", "the committed sequence would exceed the model context")
        session.tokens.extend(new)
        for t in new:
            session.counts[t] += 1.0
        session.ledger.applied(commit)
        self.sync_cache(session)  # free rejected KV now, not at the next step

    def sync_cache(self, session: Session, extra: Sequence[int] = (), min_feed: int = 1) -> None:
        """Cut the cache back to its longest prefix that agrees with ``tokens + extra``, leaving at
        least ``min_feed`` tokens of that sequence uncached (their logits are needed next)."""
        sequence = session.tokens + list(extra)
        keep = min(common_prefix_len(session.cached, sequence), len(sequence) - min_feed)
        drop = len(session.cached) - keep
        if drop > 0:
            session.cache.crop(-drop)
            del session.cached[keep:]
            session.kv_bytes = cache_nbytes(session.cache)

    def forward(self, session: Session, extra: Sequence[int] = (), rows: int = 1) -> torch.Tensor:
        """Logits of the last ``rows`` positions of the sequence ``tokens + extra``, as float32 on
        the CPU, [rows, V]. Only the uncached part is fed; afterwards ``cached`` is that sequence."""
        return self.forward_with_features(session, extra, rows, with_features=False)[0]

    def forward_with_features(
        self, session: Session, extra: Sequence[int] = (), rows: int = 1, with_features: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, and the final hidden states of the same ``rows`` positions (float32,
        CPU, [rows, H]) when ``with_features``: what a feature draft reads."""
        request = PassRequest(session, [int(t) for t in extra], rows, with_features)
        return unwrap(self.run_requests([(request, None)])[0])

    def warm(self, session: Session, with_features: bool = False) -> torch.Tensor | None:
        """Prefill: cache every committed token but the last (whose logits start the first step).
        With ``with_features``: the final hidden states of the positions fed, [fed, H] float32."""
        request = PassRequest(session, with_features=with_features, prefill=True, upto=len(session.tokens) - 1)
        if self.feed_length(request) == 0:
            return torch.zeros(0, int(self.model.config.hidden_size)) if with_features else None
        return unwrap(self.run_requests([(request, None)])[0])

    def feed_length(self, request: PassRequest) -> int:
        """How many tokens ``request`` would feed now (its rows in a pass)."""
        session = request.session
        if request.prefill:
            return max(0, request.upto - len(session.cached))
        sequence_len = len(session.tokens) + len(request.extra)
        agree = common_prefix_len(session.cached, session.tokens + request.extra)
        return sequence_len - min(agree, sequence_len - request.rows)

    def _prepare(self, request: PassRequest, chunk: int | None) -> tuple[list[int], int, int]:
        """(the tokens to feed, logits rows, feature rows) for ``request``, the cache cut back
        first; raises (touching nothing else) where the pass is not allowed."""
        session = request.session
        if session.cache is None or self._sessions.get(session.session_id) is not session:
            raise SessionNotFoundError(f"{self.name}: session {session.session_id!r} was released")
        if request.prefill:
            feed = session.tokens[len(session.cached) : request.upto]
            if chunk is not None:
                feed = feed[:chunk]
            if not feed:
                raise ValueError("a prefill request with nothing left to feed")
            self._reserve(session, len(session.cached) + len(feed))
            return feed, 0, len(feed) if request.with_features else 0
        rows = request.rows
        if not 1 <= rows <= len(session.tokens) + len(request.extra):
            raise ValueError(f"cannot return {rows} rows")
        self.sync_cache(session, request.extra, min_feed=rows)
        feed = (session.tokens + request.extra)[len(session.cached) :]
        total = len(session.cached) + len(feed)
        if total > self.context_length:
            raise InvalidArgumentError(
                "num_speculative_tokens", f"{total} tokens exceed the model context of {self.context_length}"
            )
        self._reserve(session, total)
        return feed, rows, rows if request.with_features else 0

    @torch.inference_mode()
    def run_requests(
        self, requests: list[tuple[PassRequest, int | None]]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor | BaseException | None]:
        """Run (request, chunk) pairs as ONE batched pass (``chunk``: feed only that many tokens of
        a prefill; None: all). Per request: (logits [rows, V], features or None) as float32 on the
        CPU, or for a prefill its features (or None), or the exception that refused it (a refused
        request touches nothing; the others run)."""
        out: list[Any] = [None] * len(requests)
        live: list[tuple[int, Session, list[int], int, int]] = []
        for index, (request, chunk) in enumerate(requests):
            try:
                feed, rows, feature_rows = self._prepare(request, chunk)
            except Exception as exc:  # noqa: BLE001 - refused: this request's error, not the batch's
                out[index] = exc
                continue
            live.append((index, request.session, feed, rows, feature_rows))
        if not live:
            return out
        try:
            results = self._run_many([(s.cache, feed, rows, f) for _, s, feed, rows, f in live])
        except Exception as exc:  # the pass failed: every request in it fails (a shard: the group)
            for index, session, *_ in live:
                if isinstance(session.cache, OWN_CACHES):
                    session.cache.length = len(session.cached)  # whatever the pass wrote is not cached
                out[index] = exc
            if self.pass_errors_fatal:
                raise
            return out
        host_logits = _on_host(
            [logits[logits.shape[0] - rows :] for (_, _, _, rows, _), (logits, _) in zip(live, results, strict=True)]
        )
        for (index, session, feed, _, _), (_, hidden), logits in zip(live, results, host_logits, strict=True):
            session.cached.extend(feed)
            session.kv_bytes = cache_nbytes(session.cache)
            features = hidden.to(device="cpu", dtype=torch.float32) if hidden is not None else None
            if requests[index][0].prefill:
                out[index] = features
            else:
                out[index] = (logits, features)
        return out

    def stats(self) -> dict:
        return {
            "live_sessions": len(self),
            "kv_bytes": self.total_kv_bytes,
            "kv_bytes_per_token": self.bytes_per_token,
            "sessions_started": self.sessions_started,
            "pass_backend": self.pass_backend,
            "batch_invariant": self.batch_invariant,
            **(self.runner.pool.stats() if self.runner is not None else {}),
            **(self.prefixes.stats() if self.prefixes is not None else {}),
            **(self.grammars.stats() if self.grammars is not None else {}),
        }


def _free(cache) -> None:
    """Give a paged cache's blocks back to its pool (other caches are simply dropped)."""
    if isinstance(cache, PagedCache):
        cache.release()


class SessionEngine:
    """What the draft and target engines share: sessions over one model's ``SessionStore``."""

    def __init__(self, store: SessionStore):
        self.store = store
        self.model_id = getattr(store.model.config, "_name_or_path", "") or store.name

    @property
    def batch_store(self) -> SessionStore | None:
        """The store whose passes this engine's works ask for, where a batch runner runs them
        (specdec.engine.batching); None where its works ask for none (:func:`whole`)."""
        return self.store

    def devices(self) -> list[str]:
        """Where its passes compute (modeling.loading.device_identity)."""
        return [device_identity(self.store.device)]

    @property
    def vocab_size(self) -> int:
        return self.store.vocab_size

    @property
    def context_length(self) -> int:
        return self.store.context_length

    def start_work(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, return_features: bool = False
    ) -> Work:
        """Starting a session as a work (specdec.engine.batching): the prompt is cached in as
        many passes as the scheduler's chunks take; a failure releases the session. With
        ``return_features`` its result is the model's final hidden states of every prompt
        position but the last, [len(prompt) - 1, H] (what a feature draft reads)."""
        session = self.store.create(session_id, prompt, params)
        parts: list[torch.Tensor | None] = []
        try:
            with session.lock:
                upto = len(session.tokens) - 1
                if not return_features:  # (a copied prefix has no features to return)
                    self.store.reuse_prefix(session, upto)
                request = PassRequest(session, with_features=return_features, prefill=True, upto=upto)
                while self.store.feed_length(request):
                    parts.append((yield request))
                self.store.keep_prefix(session)
        except BaseException:
            self.store.release(session_id)
            raise
        if not return_features:
            return None
        present = [p for p in parts if p is not None]
        return torch.cat(present) if present else torch.zeros(0, int(self.store.model.config.hidden_size))

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
