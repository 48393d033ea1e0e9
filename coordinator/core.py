"""The coordinator's request handling, independent of how it is hosted (a Ray actor in the
product, in process in tests): validate the public request, route it to replicas, run the
speculative loop, make every committed chunk durable (Redis) before it is sent, and resume or
take over requests whose client or coordinator was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from coordinator.config import METHODS, CoordinatorConfig
from coordinator.output_log import OutputLog
from coordinator.requests import ParsedRequest, RequestParser, canonical
from coordinator.routing import PeerPool, SessionRouting, pipelines
from specdec.engine.ngram import NgramDraft
from specdec.errors import (
    InvalidArgumentError,
    LeaseLostError,
    PeerError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
)
from specdec.loop.generate import DraftPeer, LocalDraft, SpeculativeRun
from specdec.modeling.loading import longest_token_chars, try_load_tokenizer
from specdec.runtime import wire
from specdec.runtime.registry import Registry, Replica
from specdec.telemetry import tracing
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator")


HEALTH_PROBE_S = 1.0  # a health probe's wait for Redis or a target
MAX_HEALTH_PROBES = 8  # targets probed per health check (one answering is enough)
LOG_POLL_S = 0.05  # a resumed stream's wait for new log entries
LEASE_CHECK_POLLS = 20  # ... and how many waits between looks at the lease
MAX_REQUEST_ID_CHARS = 256  # a client's request_id: a Redis key and a log field, so bounded


async def run_ahead(source: AsyncGenerator, depth: int = 1) -> AsyncIterator:
    """The items of ``source``, which runs in its own task up to ``depth`` items ahead of the
    caller: while the caller logs item n to Redis and hands it to Ray (a few ms per step), the
    next step's RPCs are already in flight. Order and exceptions are the source's; closing this
    iterator (a client gone, an error downstream) cancels the source's task and closes the source,
    so its cleanup (the sessions' release) has run when this returns."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
    end = object()

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            await queue.put((end, exc))
            return
        finally:
            await source.aclose()  # cancelled while an item waited in the queue: clean up now
        await queue.put((end, None))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _redis_errors():
    import redis.exceptions

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class CoordinatorCore:
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.registry = Registry(config.redis_url) if config.redis_url else None
        self.pool = PeerPool(
            self.registry,
            [config.target_address],
            [config.draft_address],
            config.draft_timeout_s,
            config.target_timeout_s,
            config.prefix_routing,
        )
        self.log: OutputLog | None = None
        if config.redis_url:
            self.log = OutputLog(config.redis_url, config.output_ttl_s, config.max_output_bytes)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.requests = RequestParser(config)  # the model's figures and tokenizer, set at setup
        self.model_id = ""  # the target's model, as it reports it
        self.active = 0
        self.readers = 0  # resumed streams reading the session log
        self.live_ids: set[str] = set()  # without a session log: the client-given ids in flight
        self.ngram: NgramDraft | None = None

    async def setup(self) -> None:
        """Find a target (registry or static), learn its model, load the tokenizer."""
        if self.config.default_method not in METHODS:
            raise ValueError(f"default method must be one of {METHODS}")
        await self.pool.discover_static()
        target = await self.pool.wait_for_target(self.config.startup_timeout_s)
        info = await self.pool.target_peer(target.address).info()
        requests = self.requests
        requests.vocab_size, requests.context_length = info.vocab_size, info.context_length
        self.pool.context_length = info.context_length
        for peer in self.pool._targets.values():
            peer.context_length = info.context_length
        requests.eos_token_ids = list(info.eos_token_ids)
        self.model_id = info.model_id
        # every later session goes to a target of this same model (another deployment's targets
        # in a shared Redis are ignored)
        self.pool.expected = Replica(
            "target", target.replica_id, target.address, info.model_id, info.tokenizer_fingerprint, "", info.vocab_size
        )
        spec = self.config.tokenizer or info.model_id
        requests.tokenizer = await asyncio.to_thread(try_load_tokenizer, spec) if spec else None
        if requests.tokenizer is None:
            log.warning("no tokenizer for %r: text prompts, text output and stop strings are unavailable", spec)
        else:
            requests.max_token_chars = longest_token_chars(requests.tokenizer)
        self.ngram = NgramDraft(info.vocab_size)

    def cost_model(self) -> list[tuple[str, str, list[tuple[int, float]]]]:
        """The load-aware policy's current pass-cost estimates: (kind, replica address, points)."""
        return self.pool.cost_model()

    async def health(self) -> str | None:
        """None while this coordinator can serve a request; else what it lacks: the session log's
        Redis, or every target (a hung Redis or no target must show in the health check at once,
        not as requests that stall)."""
        if self.log is not None:
            try:
                await asyncio.wait_for(self.log.redis.ping(), HEALTH_PROBE_S)
            except Exception:  # noqa: BLE001 - any failure to answer is the answer
                return "Redis (the session log and registry) is not answering"
        targets = (await self.pool.replicas("target"))[:MAX_HEALTH_PROBES]
        if not targets:
            return "no target replica is registered"
        answers = await asyncio.gather(*(self.pool.target_peer(r.address).ping(HEALTH_PROBE_S) for r in targets))
        return None if any(answers) else f"none of the {len(targets)} target replica(s) answers"

    async def close(self) -> None:
        await self.pool.close()
        for client in (self.registry, self.log):
            if client is not None:
                await client.close()

    # -- the public entry point ----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _admitted(self, logged: bool) -> AsyncIterator[None]:
        """A slot among ``max_concurrent_requests`` for one generation, taken before anything is
        written for it (a refused request leaves nothing in Redis); ``logged``: it will write the
        session log, which must have room for it (OutputLog.check_room)."""
        if self.active >= self.config.max_concurrent_requests:
            raise ResourceExhaustedError(
                f"{self.active} requests in flight, the limit is {self.config.max_concurrent_requests}"
            )
        self.active += 1  # taken before the room check's await: concurrent calls see it
        try:
            if logged:
                await self._session_log.check_room()
            yield
        finally:
            self.active -= 1

    async def generate(
        self, request: coordinator_pb2.GenerateRequest, trace_carrier: dict | None = None, durable: bool = True
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """Chunks of committed tokens; the last one carries finish_reason, seed and stats.

        ``trace_carrier``: W3C headers of the caller's span (the public gRPC call, across Ray).
        ``durable``: keep the request in the session log (resumable, taken over when its
        coordinator dies). The HTTP API passes False: an OpenAI client has no way to resume, so
        its requests write nothing to Redis."""
        if request.resume_from_index < 0:
            raise InvalidArgumentError("resume_from_index", "must be >= 0")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
            raise InvalidArgumentError(
                "request_id",
                f"must be at most {MAX_REQUEST_ID_CHARS} printable characters, got {len(request.request_id)}",
            )
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if self.log is None or not durable:
                if request.resume_from_index:
                    why = "set REDIS_URL" if self.log is None else "this API's requests are not logged"
                    raise InvalidArgumentError("resume_from_index", f"resuming needs the session log ({why})")
                if request.request_id:  # without the log, the ids in flight here (checked and taken at once)
                    if request_id in self.live_ids:
                        raise SessionExistsError(f"request_id {request_id!r} is in flight; use another")
                    self.live_ids.add(request_id)
                try:
                    parsed = self.requests.parse(request, request_id, await self.requests.encode(request))
                    async with self._admitted(logged=False):
                        async for chunk in self._generate(parsed, [], [], trace_carrier):
                            yield chunk
                finally:
                    if request.request_id:
                        self.live_ids.discard(request_id)
                return
            meta = await self.log.meta(request_id) if request.request_id else None
            if meta is None:
                if request.resume_from_index:
                    raise SessionNotFoundError(f"request_id {request_id!r}: nothing to resume (unknown or expired)")
                parsed = self.requests.parse(request, request_id, await self.requests.encode(request))
                async with self._admitted(logged=True):
                    if await self.log.create(request_id, canonical(request, request_id, parsed.resolved()), self.owner):
                        async for chunk in self._owned(parsed, [], [], 0, trace_carrier):
                            yield chunk
                        return
                meta = await self.log.meta(request_id)  # created concurrently by another call
                if meta is None:  # ... and already expired or deleted
                    raise SessionNotFoundError(f"request_id {request_id!r}: created and gone meanwhile; retry")
            async for chunk in self._resume(request, request_id, meta, trace_carrier):
                yield chunk
        except _redis_errors() as exc:
            raise PeerError("UNAVAILABLE", f"session log (Redis) unavailable: {exc}") from None

    # -- durable generation, resume, takeover --------------------------------------------------
    @property
    def _session_log(self) -> OutputLog:
        """The Redis session log (the durable paths below only run when REDIS_URL gave one)."""
        assert self.log is not None
        return self.log

    async def _owned(
        self, parsed: ParsedRequest, committed: list[int], committed_steps: list[int], from_index: int, trace_carrier
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """Generate while holding the lease: append each chunk (one step's tokens) to the log,
        then send it (the next step runs meanwhile: see :func:`run_ahead`)."""
        session_log = self._session_log
        keeper = asyncio.create_task(session_log.keep_lease(parsed.request_id, self.owner))
        tokens = list(committed)
        try:
            async for chunk in run_ahead(self._generate(parsed, committed, committed_steps, trace_carrier)):
                if keeper.done():  # the lease lapsed: another coordinator may be generating it
                    raise LeaseLostError(f"request {parsed.request_id!r}: lease lost; resume with resume_from_index")
                start = len(tokens)
                await session_log.append(parsed.request_id, start, chunk, self.owner)  # fenced
                tokens.extend(chunk.token_ids)
                out = self._trim(chunk, start, from_index, tokens)
                if out is not None:
                    yield out
        finally:
            keeper.cancel()
            with contextlib.suppress(Exception):  # the lease expires by itself
                await asyncio.shield(session_log.release_lease(parsed.request_id, self.owner))

    async def _resume(self, request, request_id: str, meta: dict, trace_carrier):
        """A resumed stream: counted against ``max_resume_readers`` (each polls the log)."""
        if self.readers >= self.config.max_resume_readers:
            raise ResourceExhaustedError(
                f"{self.readers} resumed streams are reading, the limit is {self.config.max_resume_readers}"
            )
        self.readers += 1
        try:
            async for chunk in self._read_log(request, request_id, meta, trace_carrier):
                yield chunk
        finally:
            self.readers -= 1

    async def _read_log(self, request, request_id: str, meta: dict, trace_carrier):
        session_log = self._session_log
        stored = coordinator_pb2.GenerateRequest.FromString(meta["request"])
        if canonical(request, request_id, stored) != stored.SerializeToString(deterministic=True):
            raise InvalidArgumentError("request_id", f"{request_id!r} is already used by a different request")
        from_index = request.resume_from_index
        tokens: list[int] = []
        steps: list[int] = []  # tokens per log entry, i.e. per step of the runs that wrote them
        last, polls = b"-", 0
        while True:
            # Polled, not a blocking read: a waiting reader holds no pooled connection, so readers
            # can never starve the lease refreshes and appends of the pool (issue 24).
            entries = await session_log.entries(request_id, last)
            for entry in entries:
                last = entry.entry_id
                out = self._absorb(entry, from_index, tokens, steps)
                if out is not None:
                    yield out
                if entry.chunk.finish_reason:
                    return
            if entries:
                continue
            polls += 1
            if (polls - 1) % LEASE_CHECK_POLLS:  # the lease: at the first wait, then once a second
                await asyncio.sleep(LOG_POLL_S)
                continue
            if from_index > len(tokens) and await session_log.lease_holder(request_id) is None:
                raise InvalidArgumentError(
                    "resume_from_index", f"{from_index} is past the {len(tokens)} tokens this request committed"
                )
            # Nobody is generating it (its coordinator died, or its client cancelled): take over,
            # continuing from the committed tokens with the same seed, hence the same tokens.
            if await session_log.lease_holder(request_id) is None and await session_log.acquire_lease(
                request_id, self.owner
            ):
                for entry in await session_log.entries(request_id, last):  # appended before the lease lapsed
                    last = entry.entry_id
                    out = self._absorb(entry, from_index, tokens, steps)
                    if out is not None:
                        yield out
                    if entry.chunk.finish_reason:
                        await session_log.release_lease(request_id, self.owner)
                        return
                log.info("request %s: taking over after %d committed tokens", request_id, len(tokens))
                parsed = self.requests.parse(stored, request_id, await self.requests.encode(stored))
                try:
                    async with self._admitted(logged=True):
                        async for chunk in self._owned(parsed, tokens, steps, from_index, trace_carrier):
                            yield chunk
                except ResourceExhaustedError:  # no room to take it over here: it stays resumable
                    await session_log.release_lease(request_id, self.owner)
                    raise
                return

    def _absorb(self, entry, from_index: int, tokens: list[int], steps: list[int]):
        """Adds one log entry to what a resumed call has read (its tokens, and the step that wrote
        them, for the policy's replay); returns the part of it the caller has not seen, or None.
        An entry that does not start where the read tokens end is skipped (a duplicate: appends
        are exactly-once, readers defensive all the same) or refused (a gap)."""
        if entry.start < len(tokens):
            log.warning("request log: skipping a duplicate entry at token %d", entry.start)
            return None
        if entry.start > len(tokens):
            raise PeerError("UNAVAILABLE", f"session log: entry at token {entry.start} after {len(tokens)} tokens")
        tokens.extend(entry.chunk.token_ids)
        steps.append(len(entry.chunk.token_ids))
        return self._trim(entry.chunk, entry.start, from_index, tokens)

    def _trim(self, chunk, start: int, from_index: int, tokens: list[int]):
        """The part of ``chunk`` (tokens [start, start+len)) at or after ``from_index``; None if
        nothing is left to send. ``tokens``: every token up to the end of this chunk."""
        end = start + len(chunk.token_ids)
        if start >= from_index:
            return chunk
        if end <= from_index and not chunk.finish_reason:
            return None
        out = coordinator_pb2.GenerateChunk()
        out.CopyFrom(chunk)
        cut = max(0, from_index - start)
        del out.token_ids[:]
        out.token_ids.extend(chunk.token_ids[cut:])
        del out.logprobs[:]
        out.logprobs.extend(chunk.logprobs[cut:])
        if self.requests.tokenizer is not None:  # text of the remainder only
            head = self.requests.tokenizer.decode(tokens[: min(from_index, end)], skip_special_tokens=True)
            whole = self.requests.tokenizer.decode(tokens[:end], skip_special_tokens=True)
            out.text = whole[len(head) :] if whole.startswith(head) else chunk.text
        return out

    # -- one run of the loop -------------------------------------------------------------------
    async def _generate(
        self, parsed: ParsedRequest, committed: list[int], committed_steps: list[int], trace_carrier
    ) -> AsyncGenerator[coordinator_pb2.GenerateChunk, None]:
        span = tracing.start_span(
            "specdec.request",
            trace_carrier,
            {
                "specdec.request_id": parsed.request_id,
                "specdec.method": parsed.method,
                "specdec.k": parsed.k,
                "specdec.adaptive": parsed.adaptive,
                "specdec.prompt_tokens": len(parsed.prompt_ids),
                "specdec.resumed_from": len(committed),
            },
        )
        steps = None
        try:
            run = await self._run(parsed, committed, committed_steps)
            steps = run.steps()
            final_tokens: list[int] = []
            sent = 0  # of run.token_logprobs

            def logprobs_of(tokens: list[int]) -> list:
                nonlocal sent
                if parsed.params.logprobs is None:
                    return []
                entries, sent = run.token_logprobs[sent : sent + len(tokens)], sent + len(tokens)
                return wire.token_logprobs_to_proto(entries, self.requests.tokenizer)

            while True:
                with tracing.span_as_current(span):  # never current across our own yield
                    try:
                        tokens = await steps.__anext__()
                    except StopAsyncIteration:
                        break
                if run.stopper.finished:
                    final_tokens = tokens  # they go out on the last chunk, with the stats
                    break
                if tokens:
                    yield coordinator_pb2.GenerateChunk(
                        request_id=parsed.request_id,
                        token_ids=tokens,
                        text=run.stopper.take_text(),
                        logprobs=logprobs_of(tokens),
                        prompt_tokens=len(parsed.prompt_ids),
                    )
            await steps.aclose()  # releases both sessions and closes the stats
            result = run.result()
            span.set_attribute("specdec.finish_reason", result.finish_reason)
            span.set_attribute("specdec.tokens", len(result.token_ids))
            span.set_attribute("specdec.seed", str(result.seed))
            span.set_attribute("specdec.invariant", run.params.invariant)
            yield coordinator_pb2.GenerateChunk(
                request_id=parsed.request_id,
                token_ids=final_tokens,
                text=run.stopper.take_text(final=True),
                finish_reason=result.finish_reason,
                seed=result.seed,
                prompt_tokens=len(parsed.prompt_ids),
                logprobs=logprobs_of(final_tokens),
                stats=wire.stats_to_proto(result.stats),
            )
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            if steps is not None:
                await steps.aclose()  # idempotent; on cancellation this frees the sessions
            span.end()

    async def _run(self, parsed: ParsedRequest, committed: list[int], committed_steps: list[int]) -> SpeculativeRun:
        routing = SessionRouting(self.pool, parsed.prompt_ids, parsed.params.cache_salt)
        target = await routing.first_target()
        draft: DraftPeer | None = None
        missing = False
        if parsed.k > 0:
            if parsed.method == "draft_model":
                draft = await routing.first_draft()
                missing = draft is None
            else:
                draft = LocalDraft(self.ngram)
        constraint = None
        if parsed.params.constraint is not None and parsed.k > 0:
            # compiled when the request was checked: a cache hit, a copy of the template
            constraint = await asyncio.to_thread(self.requests.grammars.matcher, parsed.params.constraint)
        run = SpeculativeRun(
            target,
            draft,
            parsed.prompt_ids,
            parsed.params,
            parsed.k,
            self.requests.eos_token_ids,
            self.requests.tokenizer,
            # Per run: a resumed or taken-over request never collides with (or releases) the
            # sessions of the run before it, which may still live until their TTL.
            # 128 random bits: a session id nobody can guess from the request id it starts with
            session_id=f"{parsed.request_id}/{secrets.token_hex(16)}",
            failover=routing,
            committed=committed,
            committed_steps=committed_steps,
            adaptive=parsed.adaptive,
            step_cost=self.config.step_cost,
            load_aware=not parsed.replayable,
            constraint=constraint,
            forced_runs=parsed.forced_tokens,
            # (an n-gram lookup in this process costs no call: nothing to take off the path)
            pipeline=parsed.method == "draft_model" and pipelines(parsed.pipeline, routing.draft, routing.target),
        )
        if missing:  # no compatible draft replica is alive: target-only steps, as for a dead draft
            log.warning("request %s: no compatible draft replica; target-only steps", parsed.request_id)
            run.stats.draft_fallbacks += 1
        return run
