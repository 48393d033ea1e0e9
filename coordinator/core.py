"""The coordinator's request handling, independent of how it is hosted (a Ray actor in the
product, in process in tests): admit a request, route it to replicas and run the speculative
loop. Parsing a request is ``coordinator.requests``'; keeping it in the session log (every chunk
durable before it is sent, resume, takeover) is ``coordinator.durable``'.
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
from coordinator.durable import DurableRequests
from coordinator.output_log import OutputLog
from coordinator.requests import ParsedRequest, RequestParser
from coordinator.routing import PeerPool, SessionRouting, pipelines, shares_hardware
from specdec.engine.ngram import NgramDraft
from specdec.errors import (
    InvalidArgumentError,
    PeerError,
    ResourceExhaustedError,
    SessionExistsError,
)
from specdec.loop.generate import DraftPeer, LocalDraft, SpeculativeRun
from specdec.loop.load_aware_k import SHARED_HARDWARE_CONTENTION
from specdec.modeling.loading import longest_token_chars, try_load_tokenizer
from specdec.runtime import wire
from specdec.runtime.grpc_server import SESSION_LOG_UNAVAILABLE
from specdec.runtime.registry import Registry, Replica
from specdec.telemetry import tracing
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator")


HEALTH_PROBE_S = 1.0  # a health probe's wait for Redis or a target
MAX_HEALTH_PROBES = 8  # targets probed per health check (one answering is enough)
MAX_REQUEST_ID_CHARS = 256  # a client's request_id: a Redis key and a log field, so bounded


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
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.requests = RequestParser(config)  # the model's figures and tokenizer, set at setup
        self.log: OutputLog | None = None
        self.durable: DurableRequests | None = None  # the session log's requests (with REDIS_URL)
        if config.redis_url:
            self.log = OutputLog(
                config.redis_url, config.output_ttl_s, config.max_output_bytes, config.max_output_bytes_per_key
            )
            self.durable = DurableRequests(
                self.log, self.owner, self.requests, config.max_resume_readers, self._admitted, self._generate
            )
        self.model_id = ""  # the target's model, as it reports it
        self.active = 0
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
                assert self.log is not None  # a logged request is one of DurableRequests'
                await self.log.check_room()
            yield
        finally:
            self.active -= 1

    async def generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        trace_carrier: dict | None = None,
        durable: bool = True,
        tenant: str = "",
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """Chunks of committed tokens; the last one carries finish_reason, seed and stats.

        ``trace_carrier``: W3C headers of the caller's span (the public gRPC call, across Ray).
        ``durable``: keep the request in the session log (resumable, taken over when its
        coordinator dies). The HTTP API passes False: an OpenAI client has no way to resume, so
        its requests write nothing to Redis. ``tenant``: the caller's API key's, whose bound on the
        session log its logged requests count against ("": no key)."""
        if request.resume_from_index < 0:
            raise InvalidArgumentError("resume_from_index", "must be >= 0")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
            raise InvalidArgumentError(
                "request_id",
                f"must be at most {MAX_REQUEST_ID_CHARS} printable characters, got {len(request.request_id)}",
            )
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if self.durable is None or not durable:
                if request.resume_from_index:
                    why = "set REDIS_URL" if self.durable is None else "this API's requests are not logged"
                    raise InvalidArgumentError("resume_from_index", f"resuming needs the session log ({why})")
                if request.request_id:  # without the log, the ids in flight here (checked and taken at once)
                    if request_id in self.live_ids:
                        raise SessionExistsError(f"request_id {request_id!r} is in flight; use another")
                    self.live_ids.add(request_id)
                try:
                    parsed = self.requests.parse(request, request_id, await self.requests.encode(request))
                    async with self._admitted(logged=False):
                        await self.requests.check_constraint(parsed)
                        async for chunk in self._generate(parsed, [], [], trace_carrier):
                            yield chunk
                finally:
                    if request.request_id:
                        self.live_ids.discard(request_id)
                return
            async for chunk in self.durable.stream(request, request_id, trace_carrier, tenant):
                yield chunk
        except _redis_errors() as exc:
            log.warning("request %s: the session log is unavailable: %r", request_id, exc)
            raise PeerError("UNAVAILABLE", SESSION_LOG_UNAVAILABLE) from None

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

    def _contention(self, routing: SessionRouting) -> float:
        """What a session's load-aware k assumes of the machine before its target's regime has
        measured it: the coordinator's --contention, else the most where the draft shares its
        target's hardware and 0 where they compute apart (docs/goodput.md, "Bursts")."""
        if self.config.contention is not None:
            return self.config.contention
        return SHARED_HARDWARE_CONTENTION if shares_hardware(routing.draft, routing.target) else 0.0

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
            # compiled when the request was admitted: a cache hit, a copy of the template
            constraint = await self.requests.constraint_matcher(parsed.params)
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
            contention=self._contention(routing),
        )
        if missing:  # no compatible draft replica is alive: target-only steps, as for a dead draft
            log.warning("request %s: no compatible draft replica; target-only steps", parsed.request_id)
            run.stats.draft_fallbacks += 1
        return run
