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
from dataclasses import dataclass, replace
from typing import Any

from coordinator.output_log import OutputLog
from coordinator.routing import PeerPool, SessionRouting
from specdec.engine.ngram import NgramDraft
from specdec.errors import (
    InvalidArgumentError,
    LeaseLostError,
    PeerError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
)
from specdec.exact.proposal import MAX_BLOCK
from specdec.exact.rng import new_seed
from specdec.exact.sampling import MAX_NEW_TOKENS_LIMIT, SamplingParams, constraint_conflict
from specdec.loop.adaptive_k import StepCost
from specdec.loop.generate import DraftPeer, LocalDraft, SpeculativeRun
from specdec.loop.reproducible import SEEDED_SAMPLING, resolve_reproducibility
from specdec.modeling.loading import encode_chat, encode_prompt, longest_token_chars, try_load_tokenizer
from specdec.runtime import wire
from specdec.runtime.registry import Registry, Replica
from specdec.telemetry import tracing
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator")

METHODS = ("draft_model", "ngram", "none")


CHAT_ROLES = ("system", "user", "assistant")
HEALTH_PROBE_S = 1.0  # a health probe's wait for Redis or a target
MAX_HEALTH_PROBES = 8  # targets probed per health check (one answering is enough)
LOG_POLL_S = 0.05  # a resumed stream's wait for new log entries
LEASE_CHECK_POLLS = 20  # ... and how many waits between looks at the lease
MAX_REQUEST_ID_CHARS = 256  # a client's request_id: a Redis key and a log field, so bounded
MAX_MESSAGES = 256  # a conversation's messages (its tokens are bounded by the context)
MAX_CACHE_SALT_CHARS = 256  # a client's cache_salt (the front may prefix its tenant's)


def check_constraint_settings(params: SamplingParams) -> None:
    """What a constraint cannot be combined with is refused here, before any replica is asked
    (docs/structured-output.md). Either sampling mode takes a constraint: both draw under its masks."""
    conflict = constraint_conflict(params)
    if conflict:
        raise InvalidArgumentError("sampling.structured_output", f"cannot be combined with {conflict}")


@dataclass(frozen=True)
class CoordinatorConfig:
    target_address: str | None = None  # static replicas (optional when a registry is used)
    draft_address: str | None = None
    redis_url: str | None = None  # registry + session log
    tokenizer: str | None = None  # model spec to load the tokenizer from (default: the target's)
    default_k: int = 4
    max_k: int = 16
    default_adaptive: bool = True  # draft-model requests that do not say: pause blocks that do not pay
    step_cost: StepCost = StepCost()  # the replayable adaptive policy's cost model (specdec.loop.adaptive_k)
    # Adaptive requests choose k from their own past only (specdec.loop.adaptive_k), not from the
    # load (specdec.loop.load_aware_k): seeded sampled output then reproduces under any load.
    replayable_schedule: bool = False
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096
    max_concurrent_requests: int = 64
    max_resume_readers: int = 64  # resumed streams reading the log at once (past it: RESOURCE_EXHAUSTED)
    invariant_sampling: bool = False  # requests that do not say sample invariantly (docs/exactness.md)
    # how a request that sends a seed and samples gets its reproducible tokens when it does not say:
    # "invariant" sampling, or rejection sampling on a "replayable" schedule (resolve_reproducibility)
    seeded_sampling: str = "invariant"
    draft_timeout_s: float = 5.0
    target_timeout_s: float = 60.0
    default_method: str = "draft_model"
    output_ttl_s: float = 600.0  # a request's session log lives this long after its last write
    max_output_bytes: int = 4 << 20  # ... and holds at most this many bytes of chunks
    startup_timeout_s: float = 120.0
    # a new session goes to the replica this coordinator last sent its prompt's prefix to, while
    # that one is not much busier than the least loaded (coordinator.affinity)
    prefix_routing: bool = True

    def __post_init__(self):
        if not 0 <= self.max_k <= MAX_BLOCK:
            raise ValueError(f"max_k must be in [0, {MAX_BLOCK}] (the longest block a replica takes), got {self.max_k}")
        if self.seeded_sampling not in SEEDED_SAMPLING:
            raise ValueError(f"seeded_sampling must be one of {SEEDED_SAMPLING}, got {self.seeded_sampling!r}")
        if isinstance(self.step_cost, dict):  # back from dataclasses.asdict (how it travels to a Ray actor)
            object.__setattr__(self, "step_cost", StepCost(**self.step_cost))


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # seed resolved
    k: int
    method: str
    adaptive: bool
    replayable: bool = False  # k from its own past only (else the load-aware policy may choose it)
    forced_tokens: bool = True  # a constraint's forced runs proposed by the loop (with k > 0)

    def resolved(self) -> coordinator_pb2.GenerateRequest:
        """The server defaults this request was given (seed, invariant, k, method, adaptive,
        replayable), as request fields."""
        out = coordinator_pb2.GenerateRequest()
        assert self.params.seed is not None  # parse() resolves it
        out.sampling.seed = self.params.seed
        out.sampling.invariant = self.params.invariant
        out.speculation.num_speculative_tokens = self.k
        out.speculation.method = self.method
        out.speculation.adaptive = self.adaptive
        out.speculation.replayable = self.replayable
        out.speculation.forced_tokens = self.forced_tokens
        return out


def canonical(
    request: coordinator_pb2.GenerateRequest, request_id: str, defaults: coordinator_pb2.GenerateRequest
) -> bytes:
    """The request as stored in the session log: id filled in, resume index cleared, and every
    field the client left to the server (seed, invariant, k, method, adaptive, replayable) taken
    from ``defaults``, so that a coordinator taking over (whatever its own defaults) runs exactly
    the same request, with the same tokens."""
    copy = coordinator_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = request_id
    copy.resume_from_index = 0
    sampling, default_sampling = copy.sampling, defaults.sampling
    for name in ("seed", "invariant"):
        if not sampling.HasField(name):
            setattr(sampling, name, getattr(default_sampling, name))
    spec, default_spec = copy.speculation, defaults.speculation
    for name in ("num_speculative_tokens", "adaptive", "replayable", "forced_tokens"):
        if not spec.HasField(name):
            setattr(spec, name, getattr(default_spec, name))
    if not spec.method:
        spec.method = default_spec.method
    return copy.SerializeToString(deterministic=True)


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
        self.tokenizer: Any = None
        self.vocab_size = 0
        self.context_length = 0
        self.eos_token_ids: list[int] = []
        self.model_id = ""  # the target's model, as it reports it
        self.max_token_chars = 0  # the tokenizer's longest token (0: no bound known)
        self.active = 0
        self.readers = 0  # resumed streams reading the session log
        self.live_ids: set[str] = set()  # without a session log: the client-given ids in flight
        self.ngram: NgramDraft | None = None
        self.grammars: Any = None  # structured output: constraints compiled over the tokenizer

    async def setup(self) -> None:
        """Find a target (registry or static), learn its model, load the tokenizer."""
        if self.config.default_method not in METHODS:
            raise ValueError(f"default method must be one of {METHODS}")
        await self.pool.discover_static()
        target = await self.pool.wait_for_target(self.config.startup_timeout_s)
        info = await self.pool.target_peer(target.address).info()
        self.vocab_size, self.context_length = info.vocab_size, info.context_length
        self.pool.context_length = info.context_length
        for peer in self.pool._targets.values():
            peer.context_length = info.context_length
        self.eos_token_ids = list(info.eos_token_ids)
        self.model_id = info.model_id
        # every later session goes to a target of this same model (another deployment's targets
        # in a shared Redis are ignored)
        self.pool.expected = Replica(
            "target", target.replica_id, target.address, info.model_id, info.tokenizer_fingerprint, "", info.vocab_size
        )
        spec = self.config.tokenizer or info.model_id
        self.tokenizer = await asyncio.to_thread(try_load_tokenizer, spec) if spec else None
        if self.tokenizer is None:
            log.warning("no tokenizer for %r: text prompts, text output and stop strings are unavailable", spec)
        else:
            self.max_token_chars = longest_token_chars(self.tokenizer)
        self.ngram = NgramDraft(self.vocab_size)

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

    # -- validation ---------------------------------------------------------------------------
    def _text_chars(self, request: coordinator_pb2.GenerateRequest) -> int:
        return len(request.prompt) + sum(len(m.content) for m in request.messages)

    async def encode(self, request: coordinator_pb2.GenerateRequest) -> list[int] | None:
        """A text prompt's or a conversation's token ids, tokenized off the event loop (a long
        text would stall every other request), after refusing text that cannot fit the context
        whatever it tokenizes to; None for a request of token ids."""
        if request.sampling.HasField("structured_output"):
            await self.check_constraint(request.sampling.structured_output)
        if not (request.prompt or request.messages) or request.prompt_token_ids:
            return None
        chars = self._text_chars(request)
        if self.max_token_chars and chars > self.context_length * self.max_token_chars:
            field = "messages" if request.messages else "prompt"
            raise InvalidArgumentError(
                field,
                f"{chars} characters cannot fit the model context of {self.context_length} tokens "
                f"(no token is longer than {self.max_token_chars} characters)",
            )
        return await asyncio.to_thread(self._encode_text, request)

    async def check_constraint(self, msg: coordinator_pb2.StructuredOutput) -> None:
        """Compile a request's constraint here, off the event loop, before any replica is asked:
        a schema or grammar that does not compile is the client's 400 naming the problem, and
        the replicas' compile caches then hold only constraints that compile."""
        try:
            constraint = wire.constraint_from_proto(msg)
            if self.tokenizer is None:
                raise InvalidArgumentError("structured_output", "this server has no tokenizer to compile it with")
            if self.grammars is None:
                from specdec.modeling.grammar import Grammars

                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            await asyncio.to_thread(self.grammars.matcher, constraint)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("sampling.structured_output", str(exc).split(": ", 1)[-1]) from None

    def _encode_text(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        if request.messages:
            return self._encode_messages(request.messages)
        if self.tokenizer is None:
            raise InvalidArgumentError("prompt", "this server has no tokenizer: send prompt_token_ids")
        return encode_prompt(self.tokenizer, request.prompt, chat=request.apply_chat_template)

    def parse(
        self, request: coordinator_pb2.GenerateRequest, request_id: str, text_ids: list[int] | None = None
    ) -> ParsedRequest:
        """The request, validated and resolved; ``text_ids``: its text already tokenized
        (:meth:`encode`), else tokenized here."""
        cfg = self.config
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
        if len(given) > 1:
            raise InvalidArgumentError(given[1], f"give one of prompt, prompt_token_ids or messages, not {given}")
        if request.messages:
            prompt_ids = text_ids if text_ids is not None else self._encode_text(request)
        elif request.prompt_token_ids:
            prompt_ids = [int(t) for t in request.prompt_token_ids]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgumentError(
                    "prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        elif request.prompt:
            prompt_ids = text_ids if text_ids is not None else self._encode_text(request)
            if not prompt_ids:
                raise InvalidArgumentError("prompt", "tokenizes to zero tokens")
        else:
            raise InvalidArgumentError("prompt", "empty: give prompt, prompt_token_ids or messages")
        if request.apply_chat_template and not request.prompt:
            raise InvalidArgumentError("apply_chat_template", "needs a text prompt")
        if len(prompt_ids) >= self.context_length:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt_ids)} tokens leave no room in the model context of {self.context_length}"
            )
        if request.sampling.max_new_tokens > cfg.max_new_tokens_limit:
            raise InvalidArgumentError(
                "sampling.max_new_tokens",
                f"{request.sampling.max_new_tokens} exceeds this server's limit of {cfg.max_new_tokens_limit}",
            )
        params = wire.sampling_from_proto(request.sampling, min(cfg.default_max_new_tokens, MAX_NEW_TOKENS_LIMIT))
        asked_invariant = request.sampling.invariant if request.sampling.HasField("invariant") else None
        if params.constraint is not None:
            check_constraint_settings(params)
        spec = request.speculation
        invariant, replayable = resolve_reproducibility(
            seeded=request.sampling.HasField("seed"),
            sampled=params.temperature > 0,
            invariant=asked_invariant,
            replayable=spec.replayable if spec.HasField("replayable") else None,
            seeded_sampling=cfg.seeded_sampling,
            invariant_default=cfg.invariant_sampling,
            replayable_default=cfg.replayable_schedule,
        )
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgumentError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
        params = replace(params, invariant=invariant, cache_salt=request.cache_salt)
        try:
            params.validate_for_vocab(self.vocab_size)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError("sampling.stop", "this server has no tokenizer to match stop strings")
        method = spec.method or cfg.default_method
        if method not in METHODS:
            raise InvalidArgumentError("speculation.method", f"unknown method {spec.method!r}; use one of {METHODS}")
        k = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else cfg.default_k
        if not 0 <= k <= cfg.max_k:
            raise InvalidArgumentError("speculation.num_speculative_tokens", f"must be in [0, {cfg.max_k}], got {k}")
        if method == "none":
            k = 0
        # By default only for draft models: an n-gram lookup costs no call, and when it finds
        # nothing the step is target-only anyway, so pausing it would only miss repetitions.
        adaptive = spec.adaptive if spec.HasField("adaptive") else cfg.default_adaptive and method == "draft_model"
        if params.seed is None:
            params = params.with_seed(new_seed())
        forced = spec.forced_tokens if spec.HasField("forced_tokens") else True
        return ParsedRequest(request_id, prompt_ids, params, k, method, adaptive, replayable, forced)

    def _encode_messages(self, messages) -> list[int]:
        """A conversation through the model's chat template, the assistant's turn to follow."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgumentError("messages", "this model has no chat template: send a prompt")
        if len(messages) > MAX_MESSAGES:
            raise InvalidArgumentError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgumentError(f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {m.role!r}")
        try:
            prompt_ids = encode_chat(self.tokenizer, [(m.role, m.content) for m in messages])
        except Exception as exc:  # noqa: BLE001 - a template may refuse an order of roles
            raise InvalidArgumentError("messages", f"the chat template refused them: {exc}") from None
        if not prompt_ids:
            raise InvalidArgumentError("messages", "tokenize to zero tokens")
        return prompt_ids

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
                    parsed = self.parse(request, request_id, await self.encode(request))
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
                parsed = self.parse(request, request_id, await self.encode(request))
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
                parsed = self.parse(stored, request_id, await self.encode(stored))
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
        if self.tokenizer is not None:  # text of the remainder only
            head = self.tokenizer.decode(tokens[: min(from_index, end)], skip_special_tokens=True)
            whole = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
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
                return wire.token_logprobs_to_proto(entries, self.tokenizer)

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
            constraint = await asyncio.to_thread(self.grammars.matcher, parsed.params.constraint)
        run = SpeculativeRun(
            target,
            draft,
            parsed.prompt_ids,
            parsed.params,
            parsed.k,
            self.eos_token_ids,
            self.tokenizer,
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
        )
        if missing:  # no compatible draft replica is alive: target-only steps, as for a dead draft
            log.warning("request %s: no compatible draft replica; target-only steps", parsed.request_id)
            run.stats.draft_fallbacks += 1
        return run
