"""The public Coordinator API -- Generate, GenerateStream and health -- as one front, whatever
hosts it.

``specdec coordinator`` (and so ``specdec serve``) puts the front behind its own grpc.aio server
(:class:`CoordinatorServicer`) and runs the request path in Ray actors
(``coordinator.ray_backend.RayBackend``). Under Ray Serve (``coordinator.serve_app``, what
Kubernetes runs) Serve's gRPC proxy calls the deployment, which calls this same front over a
request path in its own replica (:class:`LocalBackend`). Either way the front records the
Prometheus metrics from what it streams (so they equal the stats clients receive), opens the
coordinator's span of each call under the caller's trace, maps failures to statuses through one
function, and says whether it is serving: both paths report alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from coordinator.api_keys import ApiKey, ApiKeys, has_own_scope, scoped_salt
from coordinator.config import CoordinatorConfig
from coordinator.core import CoordinatorCore
from specdec.errors import ReaderStalledError, UnauthenticatedError
from specdec.runtime import wire
from specdec.runtime.grpc_server import grpc_method, status_of
from specdec.telemetry import metrics, tracing
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE = "specdec.v1.Coordinator"
COST_MODEL_POLL_SECONDS = 5.0
HEALTH_POLL_SECONDS = 2.0  # how often the front asks whether the request path can serve
HEALTH_TIMEOUT_SECONDS = 3.0  # ... and how long an answer may take (past it: not serving)
log = logging.getLogger("specdec.coordinator.front")
TRACE_HEADERS = ("traceparent", "tracestate")
BUFFERED_CHUNKS = 16  # per stream, chunks produced and not yet taken by its client
STALL_TIMEOUT_S = 60.0  # a streaming client that reads nothing this long has its generation stopped


class Backend(Protocol):
    """Where the request path runs (in this process, or in Ray actors)."""

    async def start(self) -> None: ...
    def generate(
        self, request: coordinator_pb2.GenerateRequest, carrier: dict[str, str], durable: bool = True, tenant: str = ""
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]: ...
    async def stop(self) -> None: ...
    async def cost_model(self) -> list: ...
    async def model_id(self) -> str: ...
    async def health(self) -> str | None: ...


class LocalBackend:
    """The request path in this process: a Ray Serve replica, or ``specdec coordinator --no-ray``."""

    def __init__(self, config: CoordinatorConfig):
        self.core = CoordinatorCore(config)

    async def start(self) -> None:
        await self.core.setup()

    async def generate(
        self, request: coordinator_pb2.GenerateRequest, carrier: dict[str, str], durable: bool = True, tenant: str = ""
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        async for chunk in self.core.generate(request, carrier, durable, tenant):
            yield chunk

    async def stop(self) -> None:
        await self.core.close()

    async def cost_model(self) -> list:
        return self.core.cost_model()

    async def model_id(self) -> str:
        return self.core.model_id

    async def health(self) -> str | None:
        return await self.core.health()


class CoordinatorFront:
    def __init__(
        self,
        backend: Backend,
        metrics_port: int = 0,
        model_name: str | None = None,
        keys: ApiKeys | None = None,
        metrics_host: str = "127.0.0.1",
        stall_timeout: float = STALL_TIMEOUT_S,
        report_unscoped_cached_tokens: bool = False,
    ):
        self.backend = backend
        self.keys = keys or ApiKeys([])  # who may call (none configured: anyone), and how much
        self.stall_timeout = stall_timeout  # seconds a streaming client may read nothing
        # whether a request with no scope of its own (no API key, no cache_salt) is told its
        # prefix-cache hits, which show what other such requests sent (docs/http-api.md)
        self.report_unscoped_cached_tokens = report_unscoped_cached_tokens
        self._poll: asyncio.Future | None = None
        self.serving = False  # what the health check answers: Redis and a target answer
        self.not_serving_because = "starting"
        self.on_health_change: list = []  # async callbacks(serving: bool): e.g. the gRPC health service
        self._watch: asyncio.Future | None = None
        # the served model's name (metrics labels, the HTTP API's /v1/models): given, or the
        # target's model as it reports it
        self.model_name = model_name or ""
        metrics.serve_metrics(metrics_port, metrics_host)

    async def start(self) -> None:
        await self.backend.start()
        if not self.model_name:
            self.model_name = await self.backend.model_id()
        self.serving, self.not_serving_because = True, ""
        self._poll = asyncio.ensure_future(self._poll_cost_model())
        self._watch = asyncio.ensure_future(self._watch_health())

    async def stop(self) -> None:
        await self._set_health("shutting down")
        for task in (self._poll, self._watch):
            if task is not None:
                task.cancel()
        await self.backend.stop()

    async def check_health(self) -> None:
        """Ask the request path whether it can serve, now (bounded), and publish the answer."""
        try:
            reason = await asyncio.wait_for(self.backend.health(), HEALTH_TIMEOUT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - no answer in time is not serving
            reason = f"the request path did not answer its health check ({type(exc).__name__})"
        await self._set_health(reason)

    async def _set_health(self, reason: str | None) -> None:
        serving = reason is None
        changed = serving != self.serving
        self.serving, self.not_serving_because = serving, reason or ""
        if changed:
            log.warning("now %s", "SERVING" if serving else f"NOT_SERVING: {reason}")
            for callback in self.on_health_change:
                await callback(serving)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_SECONDS)
            await self.check_health()

    async def _poll_cost_model(self) -> None:
        """The load-aware policy's cost estimates (which live where the request path runs) as
        gauges of this front's metrics."""
        while True:
            await asyncio.sleep(COST_MODEL_POLL_SECONDS)
            try:
                for kind, replica, points in await self.backend.cost_model():
                    metrics.record_cost_curve(kind, replica, points)
            except Exception as exc:  # noqa: BLE001 - metrics must never take the front down
                log.debug("cost model poll failed: %s", exc)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's API key from its ``authorization`` header or metadata (None where no keys
        are configured); UnauthenticatedError otherwise. Called before anything of the request
        is read, parsed or run: a caller without a key costs no more than this."""
        try:
            return self.keys.authenticate(authorization)
        except UnauthenticatedError:
            metrics.REQUEST_ERRORS.labels("UNAUTHENTICATED").inc()
            raise

    async def stream(
        self,
        request: coordinator_pb2.GenerateRequest,
        caller: Mapping[str, str],
        method: str = "GenerateStream",
        durable: bool = True,
        key: ApiKey | None = None,
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """The request's chunks. ``caller``: the caller's W3C trace headers (may be empty).
        ``durable``: False for a caller that cannot resume (the HTTP API): nothing is logged.
        ``key``: the caller's API key, from :meth:`authenticate` (its limit of requests in
        flight holds, its tenant scopes the prefix cache and bounds what its requests hold of the
        session log)."""
        recorder = metrics.RequestRecorder(self.model_name)
        span = tracing.start_span(f"coordinator.{method}", caller, {"rpc.method": method})
        shows_cache_hits = self.report_unscoped_cached_tokens or has_own_scope(key, request.cache_salt)
        try:
            if key is not None:
                scoped = coordinator_pb2.GenerateRequest()
                scoped.CopyFrom(request)
                scoped.cache_salt = scoped_salt(key, request.cache_salt)
                request = scoped
                span.set_attribute("specdec.api_key", key.name)
            with self.keys.slot(key):
                with tracing.span_as_current(span):
                    carrier = tracing.inject_context()
                tenant = key.tenant if key is not None else ""  # its bound on the session log
                async for chunk in self.backend.generate(request, carrier, durable, tenant):
                    if not shows_cache_hits and chunk.HasField("stats"):
                        chunk.stats.cached_prompt_tokens = 0
                    recorder.chunk(chunk)
                    if chunk.finish_reason:
                        span.set_attribute("specdec.request_id", chunk.request_id)
                        span.set_attribute("specdec.finish_reason", chunk.finish_reason)
                    yield chunk
        except Exception as exc:
            code = status_of(exc).name
            recorder.error(code)
            span.set_attribute("rpc.grpc.status_code", code)
            span.record_exception(exc)
            raise
        finally:
            recorder.close()
            span.end()

    def stream_to_reader(
        self, request: coordinator_pb2.GenerateRequest, caller: Mapping[str, str], key: ApiKey | None = None
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """GenerateStream's chunks for a client that takes them as it reads: paced by its reading
        (:func:`paced`), so one that stops reading stalls its own request and is stopped after
        the stall timeout."""
        return paced(self.stream(request, caller, key=key), self.stall_timeout)

    async def unary(
        self, request: coordinator_pb2.GenerateRequest, caller: Mapping[str, str], key: ApiKey | None = None
    ) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self.stream(request, caller, method="Generate", key=key):
            wire.add_chunk(response, chunk)
        return response


class Stalled(Exception):
    """The reader of a stream took nothing for the stall timeout."""


async def put_or_stall(queue: asyncio.Queue, item, stall_timeout: float) -> None:
    """Put ``item`` for a reader; Stalled if the reader makes no room for ``stall_timeout`` s."""
    try:
        await asyncio.wait_for(queue.put(item), stall_timeout)
    except asyncio.TimeoutError:
        raise Stalled from None


async def paced(
    stream: AsyncIterator[coordinator_pb2.GenerateChunk], stall_timeout: float, buffered: int = BUFFERED_CHUNKS
) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
    """``stream``'s chunks, never more than ``buffered`` produced ahead of the reader of this
    iterator. A gRPC server's write waits while the client's flow-control window is full, so a
    client that stops reading stops this iterator's reader: the generation behind it pauses
    (nothing more is generated or buffered for it), and once it has read nothing for
    ``stall_timeout`` seconds the generation is stopped -- its sessions and its slot freed --
    and the reader, if it ever reads again, gets the chunks already buffered, then
    ReaderStalledError."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=buffered)
    end = object()

    async def pump() -> None:
        outcome: object = end
        try:
            async for chunk in stream:
                await put_or_stall(queue, chunk, stall_timeout)
        except Stalled:
            log.warning("a client read nothing for %.0f s: its generation is stopped", stall_timeout)
            outcome = ReaderStalledError(stall_timeout)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            outcome = exc
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]  # cancels the generation, frees its sessions
        await queue.put(outcome)  # after the buffered chunks; the generation is over by now

    pumping = asyncio.ensure_future(pump())
    try:
        while True:
            item = await queue.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)


def trace_headers(metadata) -> dict[str, str]:
    """The W3C trace headers among a call's invocation metadata."""
    return {k: v for k, v in (metadata or ()) if k in TRACE_HEADERS}


def authorization_of(metadata) -> str | None:
    """A call's ``authorization`` metadata (its API key), if any."""
    return next((str(v) for k, v in (metadata or ()) if k == "authorization"), None)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The front on a grpc.aio server (the OpenTelemetry server interceptor, when tracing is on,
    has already continued the caller's trace: its span is the current one)."""

    def __init__(self, front: CoordinatorFront):
        self.front = front

    @staticmethod
    def _caller(context) -> dict[str, str]:
        return tracing.inject_context() if tracing.tracing_enabled() else trace_headers(context.invocation_metadata())

    @grpc_method
    async def Generate(self, request, context):
        key = self.front.authenticate(authorization_of(context.invocation_metadata()))
        return await self.front.unary(request, self._caller(context), key)

    @grpc_method
    async def GenerateStream(self, request, context):
        # `async def ... yield`, not context.write: the OpenTelemetry interceptor mishandles the
        # latter. Each yield returns once gRPC has taken the chunk within the client's window.
        key = self.front.authenticate(authorization_of(context.invocation_metadata()))
        async for chunk in self.front.stream_to_reader(request, self._caller(context), key):
            yield chunk
